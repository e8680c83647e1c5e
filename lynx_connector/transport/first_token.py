"""D's follow-up of P's first token (a part of `TransferSink`, service thread only; docs/PROTOCOL.md section 6).

In the concurrent flow D's params come from the proxy before P has sampled anything, so they carry no
``lynx_first_token``. P's worker learns the token a step after the prompt completes and names it in every later
``Regions`` answer for the transfer (``first_token``, -1 until then). A pull of ``split`` order (speculative)
of the concurrent flow therefore keeps asking P every ``pipeline_poll_s``, also once all of its bytes are
readable, until an answer carries the token or the pull ends (both streams done or failed: then D's Done frees
P's staging and nothing more is asked). The token is reported once, through `TransferSink.first_tokens`.

A value outside ``[0, 2**31)`` (a P bug: the frames are sealed) is ignored with a rate-limited warning and D
stops asking: the pull itself is unaffected, and the speculative scheduler then releases nothing early.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from lynx_connector.transport import protocol as proto
from lynx_connector.transport.handshake import RateLimitedLog
from lynx_connector.transport.link import PeerLink, PullState

__all__ = ["FirstTokenFollower"]


class FirstTokenFollower:
    """Mixin of `TransferSink`: it works on the sink's pulls and peers; ``_init_first_tokens`` sets up its state."""

    config: Any
    _pulls: dict[str, PullState]
    _peers: dict[Any, PeerLink]
    _ev_lock: threading.Lock
    _ev_cond: threading.Condition
    _resent: int

    def _init_first_tokens(self) -> None:
        self._first_tokens: list[tuple[str, int]] = []  # reported, not yet drained (under _ev_lock)
        self._token_log = RateLimitedLog()
        self._tokens_seen = 0

    def first_tokens(self) -> list[tuple[str, int]]:
        """(req_id, P's first token) of the concurrent-flow speculative pulls that learned it since the last call."""
        with self._ev_lock:
            out, self._first_tokens = self._first_tokens, []
        return out

    def _note_first_token(self, pull: PullState, msg: proto.Message) -> None:
        """After a side-channel answer for ``pull`` was handled: take P's first token from a Regions of the staging
        being read (its generation), once."""
        if (not isinstance(msg, proto.Regions) or msg.first_token < 0 or not pull.follows_token
                or self._pulls.get(pull.req_id) is not pull or pull.state != "transferring"
                or msg.generation != pull.generation):
            return
        if msg.first_token >= proto.MAX_TOKEN_ID:
            pull.token_given_up = True
            self._token_log.warn("bad_first_token", "ignored first token %s of %r from %s:%s (not a token id): nothing "
                                 "is released early", msg.first_token, pull.req_id, *pull.addr)
            return
        pull.first_token = msg.first_token
        self._tokens_seen += 1
        with self._ev_cond:
            self._first_tokens.append((pull.req_id, msg.first_token))
            self._ev_cond.notify_all()

    def _on_token_reply(self, pull: PullState, msg: proto.Message) -> None:
        """P's answer to a query asked only for the first token (every byte of the pull is readable already)."""
        pull.sent_at = None
        if isinstance(msg, proto.Error):  # P no longer answers for it (freed, restarted): stop asking
            pull.token_given_up = True
            return
        pull.requery_at = time.monotonic() + self.config.pipeline_poll_s

    def _follow_token(self, pull: PullState, now: float) -> float | None:
        """Ask P again for the first token every ``pipeline_poll_s`` (an unanswered query is sent again after
        ``resend_s``); returns the next time to look at the pull."""
        cfg = self.config
        peer = self._peers.get(pull.addr)
        if peer is None or peer.state != "ready":
            return None  # the handshake (or the pull's failure) comes first
        if pull.sent_at is None:
            if pull.requery_at is None:
                pull.requery_at = now + cfg.pipeline_poll_s
            elif now >= pull.requery_at:
                pull.sent_at, pull.requery_at = now, None
                peer.send(proto.Query(v=proto.VERSION, transfer_id=pull.transfer_id, token=pull.token))
        elif now - pull.sent_at >= cfg.resend_s:
            self._resent += 1
            pull.sent_at = now
            peer.send(proto.Query(v=proto.VERSION, transfer_id=pull.transfer_id, token=pull.token))
        return pull.requery_at if pull.sent_at is None else pull.sent_at + cfg.resend_s
