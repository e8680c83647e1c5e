"""``lynx proxy``: OpenAI-compatible front for disaggregated prefill/decode (1..n P, 1..n D).

Per request (``/v1/completions`` and ``/v1/chat/completions``, streaming or not), in the sequential flow:

1. send it to a prefill server with ``max_tokens=1`` (and ``max_completion_tokens=1`` for chat),
   ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false, ...}``;
2. take the ``kv_transfer_params`` from P's response (they say where D pulls the KV from);
3. send the original request to a decode server with those params, and return D's response unchanged (SSE bytes
   passed through as they arrive).

The pipelined flow (the default, ``--flow pipelined``; it needs the deployment key) sends the request
to P and D at once, with a transfer id and token the proxy mints and signs (``lynx_connector/proxy_flow.py``):
D pulls each layer as soon as P has encoded it. The first request to each P goes the sequential way (P's answer
names its side channel), as does a request P fans out (``n`` > 1). A list of prompts is sent as one request per
prompt and the answers merged (``lynx_connector/proxy_batch.py``).

Of a client's ``kv_transfer_params`` only two keys are used: ``lynx_mode`` (the transfer mode, sent to P) and
``"lynx_report": true`` (added to D's params: D then returns the request's speculation summary in
``kv_transfer_params.lynx_speculation``; without it D answers vLLM's null, unless D runs with
``report_speculation``).

Admission (``lynx_connector/admission.py``): at most ``--max-inflight`` requests per server, the least-loaded
server first; a request waits for a decode slot, then a prefill slot, in a FIFO queue of at most
``--max-queued`` for at most ``--queue-timeout`` s, and is answered 503 when it cannot get one (the limit is
named in the log). ``/lynx/stats`` shows the slots in use and the queue.

Hygiene: request bodies over ``--max-body-bytes`` are answered 413; ``--request-timeout`` bounds a whole request
(queue, P, D, stream): 504, or inside a stream vLLM's error event and ``[DONE]``. A client that disconnects
cancels the calls to P and D (so vLLM aborts the request and frees its blocks), logged as one INFO line. The
correlation id is the client's ``X-Request-Id`` when it is at most 128 characters of ``[A-Za-z0-9._:-]``,
otherwise the proxy's own ``lynx-<hex>``; it is sent to P and D, returned in the response header
``X-Request-Id`` and in every proxy log line about the request.

Errors: vLLM's own 4xx answers from P or D (bad parameter, prompt too long, unknown model) are relayed
byte for byte with their status. What the proxy produces itself is in vLLM's error shape (``proxy_http``) with a
generic message naming the side and the correlation id, the details (URL, exception) in the log only: 503 when
a server is unreachable or every slot is taken, 504 on a timeout, 502 when a server misbehaves (5xx, invalid
JSON, no ``kv_transfer_params``). ``/health`` checks every P and D ``/health``; ``/v1/models`` is passed through
to a D.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from lynx_connector.admission import Overloaded, ServerSlots
from lynx_connector.concurrent import FLOWS
from lynx_connector.limits import MAX_SECONDS
from lynx_connector.logger import configure_process_logging, init_logger
from lynx_connector.proxy_batch import prompt_list, serve_prompt_list
from lynx_connector.proxy_flow import FlowBook, prompt_on_decode, serve_pipelined
from lynx_connector.proxy_http import (
    MAX_JSON_DEPTH,
    REQUEST_ID_HEADER,
    ClientGone,
    Passthrough,
    ProxyError,
    correlation_id,
    error_response,
    listen,
    raise_fd_limit,
    too_deep,
)
from lynx_connector.proxy_upstream import (
    PREFILL_KV_PARAMS,
    Call,
    build_decode_request,
    build_prefill_request,
    decode,
    forward_headers,
    prefill,
    transport_error,
)

__all__ = ["PREFILL_KV_PARAMS", "ProxyConfig", "build_decode_request", "build_prefill_request", "create_app",
           "normalize_url", "run"]

logger = init_logger(__name__)

UPSTREAM_KEEPALIVE_S = 2.0  # below uvicorn's default keep-alive (5 s), which vLLM's OpenAI server uses
#: How the proxy's server runs (``run`` and the tests): a client that disconnects cancels its handler, and with
#: it the calls to P and D (aiohttp's ``run_app`` default is to let the handler run on).
SERVER_OPTIONS: dict[str, Any] = {"handler_cancellation": True, "access_log": None}
RID_KEY: web.RequestKey[str] = web.RequestKey("lynx_request_id", str)


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0  # longest silence tolerated from an upstream server
    health_timeout_s: float = 5.0
    max_inflight: int = 16  # per server
    max_queued: int = 256  # requests waiting for a slot, all servers of a role together
    queue_timeout_s: float = 120.0
    request_timeout_s: float = 1800.0  # a whole request: queue, P, D and the stream
    max_body_bytes: int = 4 << 20
    flow: str = "pipelined"  # or "sequential" (lynx_connector/proxy_flow.py)
    insecure_side_channel: bool = False  # sign the pipelined flow's params with the empty key (no deployment key)
    params_ttl_s: float = 300.0  # how long the params the proxy signs stay valid (P may queue the request)

    def __post_init__(self) -> None:
        """Each bad value is refused here, naming its option (``lynx proxy`` turns it into a usage error)."""
        if not self.prefill or not self.decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill = _server_urls("--prefill", self.prefill)
        self.decode = _server_urls("--decode", self.decode)
        for option, value in (("--connect-timeout", self.connect_timeout_s), ("--read-timeout", self.read_timeout_s),
                              ("--health-timeout", self.health_timeout_s), ("--queue-timeout", self.queue_timeout_s),
                              ("--request-timeout", self.request_timeout_s), ("--params-ttl", self.params_ttl_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= MAX_SECONDS):
                raise ValueError(f"{option} must be a number of seconds > 0 and <= {MAX_SECONDS:g}, got {value!r}")
        for option, value, low in (("--max-inflight", self.max_inflight, 1), ("--max-queued", self.max_queued, 0),
                                   ("--max-body-bytes", self.max_body_bytes, 1024), ("--port", self.port, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{option} must be an integer >= {low}, got {value!r}")
        if self.port > 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.flow not in FLOWS:
            raise ValueError(f"--flow must be one of {', '.join(FLOWS)}, got {self.flow!r}")
        if self.queue_timeout_s >= self.request_timeout_s:
            logger.warning("Lynx proxy: --queue-timeout %gs is not shorter than --request-timeout %gs: a request "
                           "still queued is answered 504 (request timeout), not 503 (overloaded)",
                           self.queue_timeout_s, self.request_timeout_s)


def _server_urls(option: str, urls: list[str]) -> list[str]:
    """``urls`` normalized (``normalize_url``), each an http(s) URL with a host and a valid port, none twice: the
    admission counts each server once, and the same server under two spellings would be two servers."""
    out: list[str] = []
    for raw in urls:
        url = normalize_url(raw)
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or port == 0 \
                or parts.query or parts.fragment:
            raise ValueError(f"{option} {raw!r}: expected host:port or http(s)://host:port[/path]")
        if parts.username is not None or parts.password is not None:  # the message must not repeat them
            raise ValueError(f"{option} {parts.scheme}://{parts.hostname}:{port}: a URL with credentials "
                             "(user:password@) is refused: it would be logged and shown by /health; the proxy "
                             "forwards the client's Authorization header (vLLM's --api-key) instead")
        if url in out:
            raise ValueError(f"{option} {raw!r}: names the same server as {url!r} already given")
        out.append(url)
    return out


@dataclass
class _State:
    config: ProxyConfig
    prefill_slots: ServerSlots = field(init=False)
    decode_slots: ServerSlots = field(init=False)
    models_rr: itertools.cycle = field(init=False)
    flows: FlowBook = field(init=False)
    session: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        c = self.config
        self.flows = FlowBook(_signer(c))
        self.prefill_slots = ServerSlots("prefill", c.prefill, c.max_inflight, c.max_queued, c.queue_timeout_s)
        self.decode_slots = ServerSlots("decode", c.decode, c.max_inflight, c.max_queued, c.queue_timeout_s)
        self.models_rr = itertools.cycle(c.decode)


STATE_KEY: web.AppKey[_State] = web.AppKey("lynx_proxy_state", _State)


def _signer(config: ProxyConfig) -> Any | None:
    """The pipelined flow's signer (the deployment key, as P and D read it), None when the flow is off or the
    proxy has no key: then every request goes the sequential way (logged once here)."""
    if config.flow != "pipelined":
        return None
    from lynx_connector.signing import ParamsSigner
    from lynx_connector.transport.keys import SideChannelKeyError, load_side_channel_key

    try:  # the proxy only signs (with this key): a rotation's extra key is for P and D, which verify
        key = load_side_channel_key(insecure=config.insecure_side_channel)
    except SideChannelKeyError as exc:
        logger.warning("Lynx proxy: no side-channel key, so the pipelined flow is off and every request goes "
                       "the sequential way (%s)", exc)
        return None
    return ParamsSigner(key, config.params_ttl_s)


async def _serve(state: _State, call: Call, request: web.Request, body: dict[str, Any],
                 chat: bool) -> web.StreamResponse:
    assert state.session is not None
    call.phase = "waiting for a decode slot"
    loop = asyncio.get_running_loop()
    queue_end = loop.time() + state.config.queue_timeout_s  # --queue-timeout bounds both waits together
    # D's slot first: decode capacity is what P's staged KV waits for, so P only prefills for a ready D
    async with state.decode_slots.slot() as d_url:
        if prompt_on_decode(body, chat):  # prompt logprobs: D computes the prompt whatever P would send
            state.flows.counts["decode_only"] += 1
            return await decode(state.session, call, d_url, request,
                                {k: v for k, v in body.items() if k != "kv_transfer_params"})
        call.phase = "waiting for a prefill slot"
        p_url = await state.prefill_slots.acquire(queue_end - loop.time())
        plan = state.flows.plan(p_url, body)
        if plan is not None:  # P and D at once (proxy_flow.py); it releases P's slot when P has answered
            try:
                return await serve_pipelined(state.session, state.flows, state.prefill_slots, call, request, body,
                                             chat, p_url, d_url, *plan)
            except Passthrough as refusal:  # P refused the proxy's own ticket: the sequential way instead
                if refusal.ticket_refused is None:
                    raise
                state.flows.fall_back(call.request_id, p_url, refusal)
            call.phase = "waiting for a prefill slot"
            p_url = await state.prefill_slots.acquire()  # a wait of its own: the refused call was no queueing
        try:
            params = await prefill(state.session, call, p_url, request, body, chat)
        finally:
            state.prefill_slots.release(p_url)
        state.flows.learn(p_url, body, params)
        return await decode(state.session, call, d_url, request, build_decode_request(body, params))


async def _handle_generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    cfg = state.config
    call = Call(request[RID_KEY])
    rid = call.request_id
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        async with asyncio.timeout(cfg.request_timeout_s):
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                logger.info("request %s refused: body larger than --max-body-bytes %d", rid, cfg.max_body_bytes)
                return error_response(413, f"request body larger than {cfg.max_body_bytes} bytes", rid)
            try:
                body = json.loads(raw)
            except ValueError:
                return error_response(400, "request body is not valid JSON", rid)
            except RecursionError:
                return error_response(400, "request body is nested too deeply", rid)
            if not isinstance(body, dict):
                return error_response(400, "request body must be a JSON object", rid)
            if too_deep(body):
                return error_response(400, f"request body is nested too deeply (over {MAX_JSON_DEPTH} levels)", rid)
            prompts = None if chat else prompt_list(body)
            if prompts is not None:  # one request per prompt (proxy_batch.py)
                return await serve_prompt_list(lambda c, b: _serve(state, c, request, b, chat), call, body, prompts,
                                               cfg.max_inflight)
            return await _serve(state, call, request, body, chat)
    except TimeoutError:  # the request's deadline (upstream timeouts are ProxyErrors by now)
        logger.warning("request %s: deadline of %gs (--request-timeout) passed during %s%s", rid,
                       cfg.request_timeout_s, call.phase, f" on {call.server}" if call.server else "")
        message = f"request did not complete within {cfg.request_timeout_s:g}s"
        if call.stream is not None:
            return await call.end_stream(504, message)
        return error_response(504, message, rid)
    except (asyncio.CancelledError, ClientGone) as e:
        # aiohttp cancels the handler when the client's connection closes (SERVER_OPTIONS); a write to a closed
        # connection can see it first. Either way the calls to P and D were closed on the way out.
        gone = isinstance(e, ClientGone) or request.transport is None or request.transport.is_closing()
        logger.info("request %s: %s after %.1fs during %s%s; request cancelled", rid,
                    "client disconnected" if gone else "handler cancelled (proxy stopping)", loop.time() - t0,
                    call.phase, f" on {call.server}" if call.server else "")
        if isinstance(e, ClientGone) and call.stream is not None:
            return call.stream
        raise
    except Overloaded as e:
        logger.warning("request %s refused: %s", rid, e)
        return error_response(503, "server overloaded, retry later", rid)
    except Passthrough as e:
        logger.info("request %s: %s, relayed to the client", rid, e)  # its body may quote the prompt: DEBUG
        logger.debug("request %s: the relayed body: %s", rid, e.body[:300].decode(errors="replace"))
        return e.response()
    except ProxyError as e:
        logger.warning("request %s failed: %s", rid, e.detail)
        if call.stream is not None:
            return await call.end_stream(e.status, e.message)
        return e.response(rid)
    except web.HTTPException:  # aiohttp's own answers
        raise
    except Exception:  # a bug of the proxy: this request fails in vLLM's error shape, the proxy goes on
        logger.exception("request %s: internal error of the proxy during %s", rid, call.phase)
        if call.stream is not None:
            return await call.end_stream(500, "internal error of the proxy")
        return error_response(500, "internal error of the proxy", rid)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _handle_generate(request, chat=False)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _handle_generate(request, chat=True)


async def _check(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str:
    try:
        async with session.get(url + "/health",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return "ok" if resp.status == 200 else f"HTTP {resp.status}"
    except (TimeoutError, aiohttp.ClientError) as e:
        return f"unreachable: {str(e) or type(e).__name__}"


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    cfg = state.config
    assert state.session is not None
    urls = cfg.prefill + cfg.decode
    results = await asyncio.gather(*(_check(state.session, u, cfg.health_timeout_s) for u in urls))
    prefill = dict(zip(cfg.prefill, results[: len(cfg.prefill)], strict=True))
    decode = dict(zip(cfg.decode, results[len(cfg.prefill):], strict=True))
    healthy = all(r == "ok" for r in results)
    failed = [f"prefill {u}: {r}" for u, r in prefill.items() if r != "ok"]
    failed += [f"decode {u}: {r}" for u, r in decode.items() if r != "ok"]
    body: dict[str, Any] = {"status": "ok" if healthy else "unhealthy", "prefill": prefill, "decode": decode}
    if failed:
        body["message"] = "; ".join(failed)
    return web.json_response(body, status=200 if healthy else 503)


async def handle_models(request: web.Request) -> web.StreamResponse:
    """A decode server's ``/v1/models`` (round-robin); one that is unreachable or slower than ``--health-timeout``
    is passed over for the next, and only when none answers is the error the client's."""
    state = request.app[STATE_KEY]
    assert state.session is not None
    rid = request[RID_KEY]
    timeout = aiohttp.ClientTimeout(total=state.config.health_timeout_s)
    err = None
    for _ in state.config.decode:
        url = next(state.models_rr)
        try:
            async with state.session.get(url + "/v1/models", headers=forward_headers(request, rid),
                                         timeout=timeout) as resp:
                payload = await resp.read()
                return web.Response(body=payload, status=resp.status,
                                    headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
        except (TimeoutError, aiohttp.ClientError) as e:
            err = transport_error("decode", url, e)
            logger.warning("request %s (/v1/models) failed: %s", rid, err.detail)
    assert err is not None
    return err.response(rid)


async def handle_stats(request: web.Request) -> web.Response:
    """Admission state: slots in use per server, requests queued, admitted and refused so far."""
    state = request.app[STATE_KEY]
    return web.json_response({"max_inflight": state.config.max_inflight, "max_queued": state.config.max_queued,
                              "prefill": asdict(state.prefill_slots.stats()),
                              "decode": asdict(state.decode_slots.stats()), "flow": state.config.flow,
                              "flows": dict(state.flows.counts), "pipelined_on": state.flows.signer is not None})


@web.middleware
async def _correlate(request: web.Request, handler: Any) -> web.StreamResponse:
    """Give the request its correlation id (the client's X-Request-Id when bounded)."""
    rid, refused = correlation_id(request.headers.get(REQUEST_ID_HEADER))
    request[RID_KEY] = rid
    if refused is not None:
        logger.info("request %s: the client's X-Request-Id was not used (%s)", rid, refused)
    return await handler(request)


async def _tag_response(request: web.Request, response: web.StreamResponse) -> None:
    rid = request.get(RID_KEY)
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid


def create_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (used by :func:`run` and by the tests)."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_correlate])
    state = _State(config)
    app[STATE_KEY] = state

    async def open_session(_app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s,
                                        sock_read=config.read_timeout_s)
        # Idle pooled connections are dropped before vLLM's server (uvicorn, 5 s keep-alive) closes them: reusing one
        # it is closing answers "Server disconnected" and fails the request (seen after P was paused and resumed).
        # No cap on pooled connections (aiohttp's default is 100 in all): admission bounds the calls in flight per
        # server, and a call waiting for a pooled connection counts it against --connect-timeout (504 with P and D
        # idle, /health unhealthy) once (P + D servers) x --max-inflight passed 100.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        state.session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def close_session(_app: web.Application) -> None:
        if state.session is not None:
            await state.session.close()

    app.on_response_prepare.append(_tag_response)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/lynx/stats", handle_stats)
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="prefill server base URL (repeat for several; round-robin)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="decode server base URL (repeat for several; round-robin)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--connect-timeout", type=float, default=10.0,
                        help="seconds to connect to a P or D server")
    parser.add_argument("--read-timeout", type=float, default=600.0,
                        help="longest silence (seconds) tolerated from a P or D server")
    parser.add_argument("--health-timeout", type=float, default=5.0,
                        help="seconds for each server's /health during the proxy's /health")
    parser.add_argument("--max-inflight", type=int, default=ProxyConfig.max_inflight,
                        help="requests in flight per P or D server; more wait in the proxy's queue")
    parser.add_argument("--max-queued", type=int, default=ProxyConfig.max_queued,
                        help="requests waiting for a slot before new ones are refused with 503")
    parser.add_argument("--queue-timeout", type=float, default=ProxyConfig.queue_timeout_s,
                        help="seconds a request may wait for a slot before it is refused with 503")
    parser.add_argument("--request-timeout", type=float, default=ProxyConfig.request_timeout_s,
                        help="seconds a whole request may take (queue, prefill, decode, stream) before it is "
                             "answered 504")
    parser.add_argument("--max-body-bytes", type=int, default=ProxyConfig.max_body_bytes,
                        help="largest request body accepted; larger ones are answered 413")
    parser.add_argument("--flow", choices=FLOWS, default=ProxyConfig.flow,
                        help="pipelined: send each request to P and D at once (D pulls each layer as P publishes "
                             "it; needs the deployment key, LYNX_SIDE_CHANNEL_KEY_FILE / LYNX_SIDE_CHANNEL_KEY); "
                             "sequential: P answers, then D is asked (what vLLM's router does)")
    parser.add_argument("--insecure-side-channel", action="store_true",
                        help="the deployment runs without a side-channel key (insecure_side_channel on P and D): "
                             "sign the pipelined flow's params with the empty key. Local tests only")
    parser.add_argument("--params-ttl", type=float, default=ProxyConfig.params_ttl_s,
                        help="seconds the pipelined flow's signed params stay valid for P and D")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(prefill=args.prefill, decode=args.decode, host=args.host, port=args.port,
                       connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
                       health_timeout_s=args.health_timeout, max_inflight=args.max_inflight,
                       max_queued=args.max_queued, queue_timeout_s=args.queue_timeout,
                       request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
                       flow=args.flow, insecure_side_channel=args.insecure_side_channel,
                       params_ttl_s=args.params_ttl)


def run(config: ProxyConfig) -> int:
    """Serve until interrupted (1: the address cannot be listened on)."""
    configure_process_logging()
    raise_fd_limit()
    try:  # bound first: a port in use is one line naming it, and --port 0 logs the port it got
        sock = listen(config.host, config.port)
    except OSError as exc:
        logger.error("Lynx proxy cannot listen on %s:%s (--host, --port): %s", config.host, config.port,
                     exc.strerror or exc)
        return 1
    logger.info("Lynx proxy on http://%s:%s: prefill %s, decode %s", config.host, sock.getsockname()[1],
                config.prefill, config.decode)
    web.run_app(create_app(config), sock=sock, print=None, **SERVER_OPTIONS)
    return 0
