"""P: which requests the scheduler half stages (`PrefillAdmission`, a part of `LynxConnectorScheduler`): the
transfer mode a request asks for and whether it is allowed, a prompt the staging pool can never hold, and the
concurrent flow's ticket the proxy minted (its signature, and its expiry as of the request's arrival). A refused
request is not staged; its response carries a 400-style ``lynx_error`` that the proxy answers the client with."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lynx_connector.concurrent import CONCURRENT, FLOW_KEY, TICKET_REASON_KEY
from lynx_connector.config import LynxConfig
from lynx_connector.metadata import is_ticket_part
from lynx_connector.modes import AUTO_MODE, MODE_NAMES, is_requestable
from lynx_connector.signing import ParamsRefused, ParamsSigner, RefusalLog
from lynx_connector.stats import LynxStats

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["PrefillAdmission", "bad_request"]


def bad_request(message: str, param: str, reason: str | None = None) -> dict[str, Any]:
    """A P request's 400-style ``lynx_error`` (vLLM's error shape): it is not staged, the proxy answers with it.
    ``reason`` (``lynx_reason``): why the proxy's concurrent-flow ticket was refused (signing.REFUSAL_REASONS), so
    the proxy can tell its own fault (a clock behind P's, another key) from the client's and go the sequential
    way instead."""
    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    if reason is not None:
        error[TICKET_REASON_KEY] = reason
    return error


class PrefillAdmission:
    """P's admission checks of the scheduler half (a mixin: it works on the scheduler's attributes)."""

    config: LynxConfig
    stats: LynxStats
    _signer: ParamsSigner
    _refusal_log: RefusalLog
    _refused: dict[str, dict[str, Any]]
    _longest: dict[str, int]
    _given_ticket: dict[str, tuple[str, str]]
    _save_ticket: dict[str, tuple[str, str]]
    _arrived: dict[str, float]

    def _request_mode(self, req_id: str, params: dict[str, Any]) -> str | None:
        """A request may ask for its own transfer mode (``lynx_mode`` in kv_transfer_params), so one P/D pair
        can serve and compare every scheme; otherwise the configured mode applies. An unknown mode or one the
        operator does not allow (``allowed_modes``) is refused: None, and the request's response carries a
        400-style ``lynx_error`` instead of remote-prefill params (the proxy answers the client with it)."""
        mode = params.get("lynx_mode")
        if mode is None:
            mode = self.config.mode
        if not is_requestable(mode):
            message = (f"lynx_mode {str(mode)[:64]!r} is not a transfer mode (known: {', '.join(MODE_NAMES)}, "
                       f"{AUTO_MODE})")
        elif not self.config.mode_allowed(mode):
            message = (f"lynx_mode {mode!r} is not allowed on this deployment (allowed_modes: "
                       f"{', '.join(self.config.allowed_modes)})")
        else:
            return mode
        self._refused[req_id] = bad_request(message, "kv_transfer_params.lynx_mode")
        self.stats.record_refusal("mode_not_allowed")
        self._refusal_log.warn(req_id, ParamsRefused("mode_not_allowed", message), what="lynx_mode",
                               outcome="not staged, its response carries the error")
        return None

    def _fits(self, num_tokens: int, mode: str) -> bool:
        return num_tokens <= self._longest.get(mode, num_tokens)

    def _refuse_too_long(self, request: Request, mode: str, auto: bool) -> None:
        """P: a prompt that can never fit the staging pool whole in ``mode`` is refused before it is staged, with a
        400-style ``lynx_error`` (the proxy answers the client with it and never calls D, or cancels D's call);
        before, P prefilled it, failed to stage it, and D's pull failed."""
        n, limit = request.num_prompt_tokens, self._longest[mode]
        message = (f"the prompt ({n} tokens) does not fit the prefill instance's staging pool in lynx_mode {mode!r}"
                   f"{' (auto: no allowed mode fits it)' if auto else ''}: "
                   f"at most {limit} tokens with staging_mb={self.config.staging_mb}; raise staging_mb on the "
                   "prefill instances, or ask for a mode with fewer bytes per token")
        self._refused[request.request_id] = bad_request(message, "prompt")
        self.stats.record_failure("too_large")
        self._refusal_log.note(request.request_id, "too_large", message, what="request",
                               outcome="not staged, its response carries the error")
        return None

    def on_new_request(self, request: Request) -> None:
        """P, concurrent flow: note when the request came. The proxy's ticket is checked against that time, not
        against the time vLLM schedules it: a request that waited in P's queue is not refused as expired."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and params.get(FLOW_KEY) == CONCURRENT:
            self._arrived[request.request_id] = time.time()

    def _take_given_ticket(self, request: Request) -> bool:
        """P, concurrent flow (lynx_connector/concurrent.py): the proxy minted the request's transfer id and
        token and gave them to D already; stage under them only when the proxy's signature verifies (a client
        must never choose a transfer id). False: refused, the response carries the error."""
        params, req_id = request.kv_transfer_params, request.request_id
        try:
            self._signer.verify(params, at=self._arrived.pop(req_id, None))
            tid, token = params.get("lynx_transfer_id"), params.get("lynx_token")
            if not (is_ticket_part(tid) and is_ticket_part(token)):
                raise ParamsRefused("malformed", "lynx_transfer_id and lynx_token must be 32 lower-case hex "
                                                 "characters")
            live = (*self._given_ticket.values(), *self._save_ticket.values())
            if any(t[0] == tid for t in live):  # one ticket, one request (vLLM's n > 1 children copy the params)
                raise ParamsRefused("replayed", "lynx_transfer_id is another request's: concurrent-flow params "
                                                "serve one request (the proxy sends n > 1 the sequential way)")
        except ParamsRefused as exc:
            self._refused[req_id] = bad_request(f"concurrent-flow params refused ({exc.reason}): {exc}",
                                                "kv_transfer_params", exc.reason)
            self.stats.record_refusal(exc.reason)
            self._refusal_log.warn(req_id, exc, what="concurrent-flow params", outcome="not staged, its response "
                                                                                       "carries the error")
            return False
        self._given_ticket[req_id] = (tid, token)
        return True
