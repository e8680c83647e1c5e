"""Token bucket used to pace chunk posting to an emulated link rate (`link_gbps`)."""

from __future__ import annotations

__all__ = ["TokenBucket"]


class TokenBucket:
    """Tokens are bytes, refilled at `rate` bytes/s up to `capacity`.

    The bucket starts with `initial` tokens (one chunk: the link is idle, not pre-charged with a burst), so
    moving N bytes takes about (N - initial) / rate seconds. `capacity` only absorbs wake-up jitter of the
    posting thread; it is at least one chunk so any chunk can eventually be posted.
    """

    def __init__(self, rate: float, capacity: float, initial: float, now: float) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError(f"token bucket needs rate > 0 and capacity > 0, got {rate}, {capacity}")
        self.rate = float(rate)
        self.capacity = float(capacity)
        self.tokens = min(float(initial), self.capacity)
        self._last = now

    def idle_reset(self, initial: float, now: float) -> None:
        """The link went idle: drop any credit above `initial` (an idle link does not store bandwidth)."""
        self._refill(now)
        self.tokens = min(self.tokens, float(initial))

    def _refill(self, now: float) -> None:
        if now > self._last:
            self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.rate)
            self._last = now

    def wait_time(self, nbytes: int, now: float) -> float:
        """Seconds until `nbytes` may be sent (0.0 if now)."""
        self._refill(now)
        need = min(float(nbytes), self.capacity)
        if self.tokens >= need - 1e-6:  # float slack: a refill computed from a returned wait may fall a hair short
            return 0.0
        return (need - self.tokens) / self.rate

    def consume(self, nbytes: int, now: float) -> bool:
        """Take `nbytes` tokens if available now; False (nothing taken) otherwise."""
        if self.wait_time(nbytes, now) > 0.0:
            return False
        self.tokens -= min(float(nbytes), self.capacity)
        return True
