"""D's control timers (lynx_connector/transport/timers.py) for a pull P publishes layer by layer, driven directly
with a stub of the sink's state: what `_check_deadlines` asks the transfer thread to sleep."""

from __future__ import annotations

import time
import types

from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.link import PullState
from lynx_connector.transport.timers import ControlTimers

ADDR = ("127.0.0.1", 5600)


class _Timers(ControlTimers):
    """The sink's state that `_check_deadlines` reads, with one layer-wise pull and its peer."""

    def __init__(self, pull: PullState, peer: types.SimpleNamespace) -> None:
        self.config = TransportConfig(timeout_s=30.0, resend_s=1.0)
        self._pulls = {pull.req_id: pull}
        self._peers = {ADDR: peer}
        self._resent = 0
        self.failed: list[str] = []
        self._courier = types.SimpleNamespace(due=lambda now: [], next_time=lambda: None, owed_to=lambda a: False)

    def _pulls_of(self, peer):  # noqa: ANN001, ANN202
        return [p for p in self._pulls.values() if p.addr == peer.addr]

    def _fail(self, pull: PullState, err: str) -> None:
        self.failed.append(err)

    def _keep_alive(self, peer, now):  # noqa: ANN001, ANN202
        return None


def _setup(state: str, **pull_fields: float) -> tuple[_Timers, PullState, list]:
    now = time.monotonic()
    sent: list = []
    peer = types.SimpleNamespace(addr=ADDR, state=state, heard_at=now, asked_at=now, opened_at=now, hello_at=now,
                                 lease_s=120.0, keepalive_at=0.0, name="p", silent_for=lambda t: 0.0,
                                 silence_deadline=lambda r: None, send=sent.append)
    pull = PullState("r1", ADDR, "a" * 32, "b" * 32, (0, 100), None, t0=now - 5, deadline=now + 100,
                     state="transferring", ready=(40, 0), progress_at=now - 1.0, **pull_fields)
    return _Timers(pull, peer), pull, sent


def test_partial_pull_waits_for_a_re_handshaking_peer_without_spinning() -> None:
    """A query due (or a resend due) while P's session is being set up again (a reconnect): the thread must
    sleep until the handshake's reply or the stall deadline, not poll with timeout 0 (review: a busy loop that
    took a core from D's engine for up to timeout_s)."""
    for fields in ({"requery_at": time.monotonic() - 0.5}, {"sent_at": time.monotonic() - 5.0}):
        timers, pull, sent = _setup("hello", **fields)
        wait = timers._check_deadlines(None)
        assert wait is not None and wait > 25.0, (fields, wait)  # progress_at + timeout_s, 29 s away
        assert sent == [] and timers.failed == []
        timers._peers[ADDR].state = "ready"  # the handshake completed: the due query goes out at once
        timers._check_deadlines(None)
        assert [type(m).__name__ for m in sent] == ["Query"], fields


def test_partial_pull_with_a_ready_peer_follows_its_query_timers() -> None:
    timers, pull, sent = _setup("ready", requery_at=time.monotonic() + 0.2)
    wait = timers._check_deadlines(None)
    assert wait is not None and 0.0 < wait <= 0.2 and sent == []


def test_partial_pull_that_stalls_fails_whatever_the_peer_state() -> None:
    timers, pull, sent = _setup("hello")
    pull.progress_at = time.monotonic() - 31.0
    timers._check_deadlines(None)
    assert len(timers.failed) == 1 and "published no more" in timers.failed[0]
