"""The proxy's pipelined flow (issue 15.3, docs/PROTOCOL.md section 6): a request goes to P and D at once.

``lynx proxy`` (``--flow pipelined``, the default; ``--flow sequential`` turns it off) sends a request to its
prefill and decode servers concurrently, so D allocates the request's blocks and is ready to pull while P still computes the prompt; P publishes each
layer as soon as it is encoded (``layerwise``), and D reads it at once. The sequential flow (P answers, then D
is asked) stays what vLLM's router and NixlConnector speak, and what the proxy uses when the pipelined one
cannot apply:

- the proxy has no deployment key (``LYNX_SIDE_CHANNEL_KEY_FILE`` / ``LYNX_SIDE_CHANNEL_KEY``, or
  ``--insecure-side-channel`` for a deployment without one): it must sign what it sends P and D;
- it has not yet learned that prefill server's side channel and default mode: the first request to each P
  goes the sequential way, and P's answer tells it both (:class:`FlowBook`);
- the request fans out on P (``n`` > 1, ``best_of``, a list of prompts): its children's transfers are named
  by P's answer (lynx_connector/fanout.py).

Failures: P's 4xx (e.g. a refused ``lynx_mode``) cancels the call to D (vLLM aborts it and frees its blocks) and
is relayed as in the sequential flow; P refusing the proxy's own ticket (``lynx_reason``: a proxy clock behind
P's, another key) is the proxy's fault, so that request goes the sequential way instead (``FlowBook.fall_back``). P unreachable or failing (5xx, dead mid-prefill) leaves D's call alone: D's
pull fails (no layer for ``timeout_s``, or nothing published within ``concurrent_wait_s``) and D's
``kv_load_failure_policy`` decides (recompute: D answers; fail: D's error is relayed). D failing, or the client
leaving, cancels the call to P (P aborts the request and frees its staging). Nothing is left behind on either side.

Bursts: D takes its staging for a request only once P has staged it (``TransferSink.watch`` / ``attach``), so
D's pool holds only requests P holds too, and a burst larger than both pools drains in order as in the sequential
flow (tests/integration/test_load_recovery.py) instead of filling D's pool with pulls waiting for P while P's
pool waits for D's room.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from lynx_connector.admission import ServerSlots
from lynx_connector.auto import AUTO_KEY
from lynx_connector.concurrent import PrefillEndpoint, decode_params, mint, prefill_params
from lynx_connector.logger import init_logger
from lynx_connector.modes import AUTO_MODE
from lynx_connector.proxy_http import Passthrough, ProxyError, error_response
from lynx_connector.proxy_upstream import Call, build_decode_request, decode, prefill
from lynx_connector.signing import ParamsRefused
from lynx_connector.trace import trace

logger = init_logger(__name__)

__all__ = ["FlowBook", "prompt_on_decode", "serve_pipelined"]

#: How long D's finished answer waits for P's verdict (P accepted or refused the request) before it goes out.
VERDICT_WAIT_S = 30.0
#: How long a prefill server that refused the proxy's ticket gets the sequential flow (FlowBook.fall_back).
SUSPEND_S = 60.0

@dataclass
class FlowBook:
    """What the proxy knows to run the pipelined flow: its signer (None: sequential only) and, per prefill
    server, its side channel and default transfer mode (learned from its answers)."""

    signer: Any | None  # lynx_connector.signing.ParamsSigner
    endpoints: dict[str, PrefillEndpoint] = field(default_factory=dict)
    default_mode: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"pipelined": 0, "sequential": 0, "decode_only": 0,
                                                            "fallback": 0})
    #: prefill server -> monotonic time until which it gets the sequential flow (it refused the proxy's tickets)
    suspended: dict[str, float] = field(default_factory=dict)

    def learn(self, p_url: str, body: dict[str, Any], params: dict[str, Any]) -> None:
        """From P's answer (either flow): P's side channel, and its default mode when the client named none."""
        endpoint = PrefillEndpoint.from_params(params)
        if endpoint is not None:
            self.endpoints[p_url] = endpoint
        mode = params.get("lynx_mode")
        if isinstance(mode, str) and client_mode(body) is None:
            self.default_mode[p_url] = AUTO_MODE if params.get(AUTO_KEY) else mode  # P's own mode is auto

    def forget(self, p_url: str) -> None:
        """P failed: its side channel may have changed (a restart); learn it again from a sequential answer."""
        self.endpoints.pop(p_url, None)

    def plan(self, p_url: str, body: dict[str, Any]) -> tuple[PrefillEndpoint, str] | None:
        """(P's side channel, the request's mode) when this request can go the pipelined way, else None."""
        endpoint = self.endpoints.get(p_url)
        mode = client_mode(body) or self.default_mode.get(p_url)
        # auto: P picks the mode as it prefills and names it to D in its side-channel Regions (protocol v3)
        if (self.signer is None or endpoint is None or mode is None or fans_out(body)
                or time.monotonic() < self.suspended.get(p_url, 0.0)):
            self.counts["sequential"] += 1
            return None
        self.counts["pipelined"] += 1
        return endpoint, mode


    def fall_back(self, request_id: str, p_url: str, refusal: Passthrough) -> None:
        """P refused the proxy's own ticket for this request (``refusal.ticket_refused``): the proxy's fault, not
        the client's. The request goes the sequential way (P signs its own params), and so does every request to
        that P for ``SUSPEND_S``, so a proxy whose clock or key is wrong costs one prefill per P per interval, not
        one per request. The first refusal of an interval is a warning that says what to fix."""
        self.counts["fallback"] += 1
        reason = refusal.ticket_refused
        if time.monotonic() < self.suspended.get(p_url, 0.0):
            logger.info("request %s: prefill server %s refused the proxy's ticket (%s); sent the sequential way",
                        request_id, p_url, reason)
            return
        self.suspended[p_url] = time.monotonic() + SUSPEND_S
        skew = refusal.peer_clock_ahead_s
        fix = _TICKET_FIX.get(reason, "Do the proxy and P run the same lynx-connector version?")
        ttl = getattr(self.signer, "ttl_s", None)
        if reason == "expired" and skew is not None and ttl is not None and skew < ttl / 2:
            fix = ("The clocks agree: the request took longer than --params-ttl to reach P (P overloaded, or a "
                   "--params-ttl too short for its queue).")
        logger.warning("request %s: prefill server %s refused the proxy's concurrent-flow ticket (%s%s): this "
                       "request and every request to that server for the next %gs go the sequential way (P signs "
                       "their params). %s", request_id, p_url, reason,
                       f"; its clock, by its HTTP Date header, is {skew:.0f} s ahead of the proxy's"
                       if reason == "expired" and skew is not None else "", SUSPEND_S, fix)


_TICKET_FIX = {
    "expired": "The proxy's clock must agree with P's well within --params-ttl: run NTP on the proxy host too.",
    "bad_signature": "The proxy must sign with the deployment's side-channel key (LYNX_SIDE_CHANNEL_KEY_FILE), "
                     "the one P and D verify with.",
    "unsigned": "P has a side-channel key and the proxy none (--insecure-side-channel): give the proxy the key.",
}


def prompt_on_decode(body: dict[str, Any], chat: bool) -> bool:
    """Whether D computes the prompt itself whatever P sends: vLLM skips external KV for a request that asks for
    prompt logprobs (its ``skip_reading_prefix_cache``): ``prompt_logprobs``, a completion's ``echo`` with
    ``logprobs``, a chat's ``echo`` (whose ``top_logprobs`` defaults to 0, so echo alone asks for them). The
    proxy then asks D alone, sparing P a prefill and staging nobody reads."""
    if body.get("prompt_logprobs") is not None:
        return True
    echo_logprobs = body.get("top_logprobs", 0) if chat else body.get("logprobs")
    return bool(body.get("echo")) and echo_logprobs is not None


def client_mode(body: dict[str, Any]) -> str | None:
    params = body.get("kv_transfer_params")
    mode = params.get("lynx_mode") if isinstance(params, dict) else None
    return mode if isinstance(mode, str) else None


def fans_out(body: dict[str, Any]) -> bool:
    """Whether P may run several requests for it (``n`` or ``best_of`` other than 1, a list of prompts). Any value
    but an absent one, null or 1 counts: vLLM's validation turns ``3.0`` or ``"3"`` into 3, and a value it
    refuses is refused by P whichever way it goes."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return several or any(_several(body.get(key)) for key in ("n", "best_of"))


def _several(value: Any) -> bool:
    return value is not None and not (value == 1 and not isinstance(value, bool))


async def serve_pipelined(session: aiohttp.ClientSession, book: FlowBook, prefill_slots: ServerSlots,
                          call: Call, request: web.Request, body: dict[str, Any], chat: bool, p_url: str,
                          d_url: str, endpoint: PrefillEndpoint, mode: str) -> web.StreamResponse:
    """Send the request to P (``p_url``, whose slot the caller holds: released when P answers) and D at once;
    D's answer is the client's."""
    assert book.signer is not None
    transfer_id, token = mint()
    try:  # a client's mode the params cannot carry (ParamsRefused): refused here, as P and D would refuse it
        p_params = book.signer.sign(prefill_params(transfer_id, token, mode))
        d_params = book.signer.sign(decode_params(endpoint, call.request_id, transfer_id, token, mode))
        d_body = build_decode_request(body, d_params)  # before P's call starts: nothing fails between the two
    except ParamsRefused as exc:
        prefill_slots.release(p_url)
        logger.info("request %s refused: %s", call.request_id, exc)
        return error_response(400, f"kv_transfer_params refused: {exc}", call.request_id)
    except BaseException:
        prefill_slots.release(p_url)
        raise
    p_call = Call(call.request_id)
    call.trace_key = transfer_id
    trace("proxy", transfer_id, "start", mode=mode)
    held = [True]

    def release() -> None:  # once, whether P answered, failed, or its task was cancelled before it ran
        if held[0]:
            held[0] = False
            prefill_slots.release(p_url)

    async def run_prefill() -> dict[str, Any]:
        try:
            return await prefill(session, p_call, p_url, request, body, chat, kv_params=p_params)
        finally:
            release()
            trace("proxy", transfer_id, "p_answered")

    p_task = asyncio.create_task(run_prefill())

    async def p_verdict() -> None:
        """D's answer reaches the client only once P has accepted the request: P's refusal (4xx) is the answer
        then, as in the sequential flow (D may have computed the prompt itself, having refused the params too).
        P failing otherwise leaves the answer to D (its kv_load_failure_policy); a P silent for
        ``VERDICT_WAIT_S`` after D answered does too, and its call is cancelled then (D computed the prompt
        itself: P would prefill and stage it for nobody, holding its slot and staging)."""
        try:
            await asyncio.wait_for(asyncio.shield(p_task), VERDICT_WAIT_S)
        except Passthrough:
            raise
        except TimeoutError:
            logger.info("request %s: prefill server %s had not answered %gs after D's answer; its call is "
                        "cancelled", call.request_id, p_url, VERDICT_WAIT_S)
            p_task.cancel()  # P aborts the request; run_prefill's finally gives its slot back
        except ProxyError:
            return

    d_task = asyncio.create_task(decode(session, call, d_url, request, d_body, gate=p_verdict))
    try:
        await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if p_task.done() and not p_task.cancelled() and isinstance(p_task.exception(), Passthrough):  # refused
            await _cancel(d_task)
            exc = p_task.exception()
            assert isinstance(exc, Passthrough)
            raise exc
        out = await d_task
    except BaseException:
        await _cancel(d_task)
        await _cancel(p_task)  # P aborts the request and frees its staging
        release()
        _after_prefill(book, call.request_id, p_url, body, p_task)  # D failed: what P said still counts
        raise
    p_task.add_done_callback(lambda t: (release(), _after_prefill(book, call.request_id, p_url, body, t)))
    return out


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _after_prefill(book: FlowBook, request_id: str, url: str, body: dict[str, Any], task: asyncio.Task[Any]) -> None:
    """P's answer in the pipelined flow: D got the KV already, but it names P's side channel as it is now (a P
    restarted at the same URL listens on new ports: learned here, not used stale for good). P failing makes the
    proxy forget its side channel: the next request to it goes the sequential way and learns it afresh."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is None:
        book.learn(url, body, task.result())
        return
    if isinstance(exc, Passthrough):  # P refused: relayed to the client, or the sequential way (fall_back)
        return
    book.forget(url)  # P failed: its side channel may be gone
    logger.info("request %s: prefill server %s failed in the pipelined flow (D's kv_load_failure_policy "
                "applied): %s", request_id, url, getattr(exc, "detail", exc))
