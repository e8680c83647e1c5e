"""The emulated link that paces D's pulls to ``link_gbps``: a virtual clock, not a credit."""

from __future__ import annotations

import math

__all__ = ["VirtualLink"]


class VirtualLink:
    """A link of ``rate`` bytes/s that moves posted chunks one after another, in posting order.

    A chunk reserved at ``now`` starts when the link frees, or at ``now`` if the link is idle (an idle link stores
    no bandwidth), and is delivered ``nbytes / rate`` later: D reports it complete no sooner than that, however
    fast the real transfer was. So N bytes take N / rate from the first post, never less, and no chunk rides on
    credit saved while the link waited for P (the token bucket this replaces started every busy period with one
    chunk of credit: 1.3 s of a 0.0067 Gbit/s link, which int4 spent and a speculative request's residual slices
    did not leave to its anchor).

    The next chunk may be posted once the link is free, so a newly queued anchor waits behind the chunk in
    progress only. A posting thread that was waiting for the link (``backlogged``) and wakes up to ``catch_up_s``
    late starts its chunk when the link freed, not when it woke: the link does not idle for the thread's
    lateness (on the loaded 2-core box 5 ms lost up to half the rate at 25 Gbit/s).
    """

    def __init__(self, rate: float, catch_up_s: float) -> None:
        if not rate > 0 or not math.isfinite(rate) or not catch_up_s >= 0:
            raise ValueError(f"virtual link needs rate > 0 and catch_up_s >= 0, got {rate}, {catch_up_s}")
        self.rate = float(rate)
        self.catch_up_s = float(catch_up_s)
        self.free_at = -math.inf  # when the last reserved chunk is delivered

    def wait_time(self, now: float) -> float:
        """Seconds until the link is free for another chunk (0.0 if now)."""
        return max(0.0, self.free_at - now)

    def reserve(self, nbytes: int, now: float, backlogged: bool = False) -> float:
        """Put ``nbytes`` on the link at ``now``; returns when they are delivered. ``backlogged``: the chunk was
        waiting for the link, so a late wake-up (at most ``catch_up_s``) does not leave it idle."""
        late = now - self.free_at
        start = self.free_at if backlogged and 0.0 <= late <= self.catch_up_s else max(now, self.free_at)
        self.free_at = start + nbytes / self.rate
        return self.free_at
