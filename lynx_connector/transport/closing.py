"""How D's `TransferSink` closes (a part of it): the service thread winds down first, telling each P to free what
D will no longer read, and a constructor that fails part-way closes what it had opened."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from lynx_connector.logger import init_logger
from lynx_connector.transport.link import Addr, DoneCourier, PeerLink, PullState

__all__ = ["CLOSE_LINGER_MS", "CLOSE_TIMEOUT_S", "SinkClosing", "stop_service_thread"]

logger = init_logger(__name__)

#: How long close() waits for the service thread to wind down (and, if it is stuck, for it to stop), seconds.
CLOSE_TIMEOUT_S = 1.0
#: How long the peers' sockets may still send at close (the last Dones), milliseconds.
CLOSE_LINGER_MS = 200


def stop_service_thread(thread: threading.Thread, teardown: Callable[[], None], what: str) -> None:
    """Join a source's or sink's service thread (told to stop) for 5 s, then ``teardown`` (its sockets, NIXL agent
    and zmq context). A stuck thread's resources are not closed under it (zmq sockets are not thread-safe) but by a
    daemon thread once it stops: a context left open would hang whoever garbage-collects it, in term()."""
    thread.join(timeout=5.0)
    if not thread.is_alive():
        teardown()
        return
    logger.warning("%s: its service thread did not stop within 5 s; its sockets and NIXL agent are closed when it "
                   "does", what)

    def after() -> None:
        thread.join()
        teardown()

    threading.Thread(target=after, name=f"{thread.name}-teardown", daemon=True).start()


class SinkClosing:
    """Close and undo-init of `TransferSink` (a mixin: it works on the sink's attributes)."""

    name: str
    _stop: bool
    _closing: threading.Event
    _closed: threading.Event
    _winding_down: bool
    _cmds: queue.SimpleQueue[tuple[Any, ...]]
    _peers: dict[Addr, PeerLink]
    _pulls: dict[str, PullState]
    _courier: DoneCourier
    _sched: Any
    _nixl: Any
    _ctx: Any
    _waker: Any
    _thread: threading.Thread
    _finish: Callable[[PullState], None]
    _drop_peer_resources: Callable[..., None]

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop: the service thread first runs the commands queued before (discards, aborts), drops every pull
        still live and tells each P to free (a Done per pull; the Dones still owed are resent), and goes on until P
        acknowledged them all (a handshake first, where no session was up) or ``timeout_s`` passed; then it stops.
        Bounded by ``timeout_s`` (+ 5 s to join a stuck thread)."""
        if self._stop or self._closing.is_set():
            return
        self._closing.set()
        self._cmds.put(("close", None, None))
        self._waker.wake()
        self._closed.wait(timeout_s)
        self._stop = True
        self._waker.wake()
        stop_service_thread(self._thread, self._teardown, f"lynx sink {self.name}")

    def _teardown(self) -> None:
        """Close the sockets, NIXL agent and zmq context (the service thread has stopped)."""
        self._sched.close()
        for peer in self._peers.values():
            self._drop_peer_resources(peer, linger_ms=CLOSE_LINGER_MS)
        self._peers.clear()
        self._waker.close()
        self._nixl.close()
        self._ctx.term()

    def _close_pulls(self) -> None:
        """Closing: every pull still live is dropped and its P told to free (a Done each, resent by the courier until
        acknowledged). The Dones owed from before whose back-off would outlast the close are due again at once; not
        those sent lately (P counts a second Done of a transfer it freed as an unknown request)."""
        self._courier.hurry(time.monotonic())
        for pull in list(self._pulls.values()):
            self._sched.cancel(pull.req_id)
            self._finish(pull)
        # the loop goes on (handshakes, resends) until every Done is acknowledged or close() stops waiting
        self._winding_down = True

    def _undo_init(self) -> None:
        """The constructor failed part-way: close what it opened; the sink owns its NIXL agent from the start, a
        caller's too (as close() does)."""
        if getattr(self, "_sched", None) is not None:
            self._sched.close()
        if getattr(self, "_waker", None) is not None:
            self._waker.close()
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
        self._nixl.close()
