"""``lynx proxy``: OpenAI-compatible front for disaggregated prefill/decode (1..n P, 1..n D).

Per request (``/v1/completions`` and ``/v1/chat/completions``, streaming or not):

1. send it to a prefill server (round-robin) with ``max_tokens=1`` (and ``max_completion_tokens=1`` for
   chat), ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill":
   false, ...}``;
2. take the ``kv_transfer_params`` from P's response (they say where D pulls the KV from);
3. send the original request to a decode server (round-robin) with those params, and return D's
   response unchanged (SSE bytes passed through as they arrive).

Admission (``lynx_connector/admission.py``): at most ``--max-inflight`` requests per server, the least-loaded
server first; a request waits for a decode slot, then a prefill slot, in a FIFO queue of at most
``--max-queued`` for at most ``--queue-timeout`` s, and is answered 503 naming the limit when it cannot get one.
``/lynx/stats`` shows the slots in use and the queue.

``/health`` checks every P and D ``/health``; ``/v1/models`` is passed through to a D. Errors are OpenAI
style JSON ``{"error": {"message", "type", "code"}}`` naming the side that failed: 503 when a server is
unreachable, 504 on a timeout, 502 when it misbehaves (5xx, no ``kv_transfer_params``); 4xx answers
(bad request, prompt too long) are passed through with their status.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from lynx_connector.admission import Overloaded, ServerSlots
from lynx_connector.logger import init_logger

logger = init_logger(__name__)

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
UPSTREAM_KEEPALIVE_S = 2.0  # below uvicorn's default keep-alive (5 s), which vLLM's OpenAI server uses


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

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        if self.max_inflight < 1 or self.max_queued < 0 or not self.queue_timeout_s > 0:
            raise ValueError("--max-inflight must be >= 1, --max-queued >= 0 and --queue-timeout > 0")
        self.prefill = [normalize_url(u) for u in self.prefill]
        self.decode = [normalize_url(u) for u in self.decode]


class UpstreamError(Exception):
    """A P or D failure turned into the proxy's HTTP answer."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.err_type)


def error_response(status: int, message: str, err_type: str) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "code": status}}
    return web.json_response(body, status=status)


@dataclass
class _State:
    config: ProxyConfig
    prefill_slots: ServerSlots = field(init=False)
    decode_slots: ServerSlots = field(init=False)
    models_rr: itertools.cycle = field(init=False)
    session: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        c = self.config
        self.prefill_slots = ServerSlots("prefill", c.prefill, c.max_inflight, c.max_queued, c.queue_timeout_s)
        self.decode_slots = ServerSlots("decode", c.decode, c.max_inflight, c.max_queued, c.queue_timeout_s)
        self.models_rr = itertools.cycle(c.decode)


STATE_KEY: web.AppKey[_State] = web.AppKey("lynx_proxy_state", _State)


def build_prefill_request(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """P's copy of the request: one token, no streaming, remote decode requested."""
    req = copy.deepcopy(body)
    req["max_tokens"] = 1
    if chat:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    req.pop("min_tokens", None)
    params = dict(PREFILL_KV_PARAMS)
    client = body.get("kv_transfer_params")
    if isinstance(client, dict) and isinstance(client.get("lynx_mode"), str):
        # The one key a client may set: the transfer mode of this request (P encodes with it, D follows P).
        params["lynx_mode"] = client["lynx_mode"]
    req["kv_transfer_params"] = params
    return req


def _forward_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
    headers.setdefault("X-Request-Id", request_id)
    return headers


def _side_error(side: str, url: str, exc: BaseException) -> UpstreamError:
    if isinstance(exc, TimeoutError):
        return UpstreamError(504, f"{side} server {url} timed out", f"{side}_timeout")
    return UpstreamError(503, f"{side} server {url} unreachable: {exc}", f"{side}_unavailable")


async def _upstream_status_error(side: str, url: str, resp: aiohttp.ClientResponse) -> UpstreamError:
    text = (await resp.text())[:2000]
    if 400 <= resp.status < 500:  # the client's fault: pass the status through
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text
        return UpstreamError(resp.status, f"{side} server {url}: {message}", "invalid_request_error")
    return UpstreamError(502, f"{side} server {url} returned HTTP {resp.status}: {text}", f"{side}_error")


async def _prefill(state: _State, url: str, request: web.Request, body: dict[str, Any], chat: bool,
                   path: str, request_id: str) -> dict[str, Any]:
    assert state.session is not None
    try:
        async with state.session.post(url + path, json=build_prefill_request(body, chat),
                                      headers=_forward_headers(request, request_id)) as resp:
            if resp.status != 200:
                raise await _upstream_status_error("prefill", url, resp)
            try:
                answer = await resp.json(content_type=None)
            except ValueError as e:
                raise UpstreamError(502, f"prefill server {url} returned invalid JSON: {e}",
                                    "prefill_error") from e
    except (TimeoutError, aiohttp.ClientError) as e:
        raise _side_error("prefill", url, e) from e
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or not params:
        raise UpstreamError(
            502,
            f"prefill server {url} returned no kv_transfer_params; is it running with a KV connector "
            "(e.g. --kv-transfer-config lynx)?",
            "prefill_error",
        )
    error = params.get("lynx_error")
    if isinstance(error, dict) and not params.get("do_remote_prefill"):
        # P refused the request's Lynx parameters (e.g. a lynx_mode the operator does not allow): the client's
        # fault, answered with P's status (400) and message
        code = error.get("code")
        raise UpstreamError(code if isinstance(code, int) and 400 <= code < 500 else 400,
                            f"prefill server {url}: {str(error.get('message', 'request refused'))[:500]}",
                            "invalid_request_error")
    logger.debug("request %s prefilled on %s: kv_transfer_params=%s", request_id, url, params)
    return params


async def _decode(state: _State, url: str, request: web.Request, body: dict[str, Any], path: str,
                  request_id: str) -> web.StreamResponse:
    assert state.session is not None
    try:
        resp = await state.session.post(url + path, json=body,
                                        headers=_forward_headers(request, request_id))
    except (TimeoutError, aiohttp.ClientError) as e:
        raise _side_error("decode", url, e) from e
    try:
        if resp.status != 200:
            raise await _upstream_status_error("decode", url, resp)
        content_type = resp.headers.get("Content-Type", "application/json")
        if not body.get("stream"):
            try:
                payload = await resp.read()
            except (TimeoutError, aiohttp.ClientError) as e:
                raise _side_error("decode", url, e) from e
            return web.Response(body=payload, status=resp.status,
                                headers={"Content-Type": content_type})
        out = web.StreamResponse(status=200, headers={"Content-Type": content_type,
                                                      "Cache-Control": "no-cache"})
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except (TimeoutError, aiohttp.ClientError) as e:
            logger.warning("request %s: decode server %s failed mid-stream: %s", request_id, url, e)
            event = {"error": {"message": f"decode server {url} failed mid-stream: {e}",
                               "type": "decode_error", "code": 502}}
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
        await out.write_eof()
        return out
    finally:
        resp.release()


async def _handle_generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        body = await request.json()
    except ValueError:
        return error_response(400, "request body is not valid JSON", "invalid_request_error")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object", "invalid_request_error")
    path = request.path
    request_id = request.headers.get("X-Request-Id") or f"lynx-{uuid.uuid4().hex}"
    try:
        # D's slot first: decode capacity is what P's staged KV waits for, so P only prefills for a ready D
        async with state.decode_slots.slot() as d_url:
            async with state.prefill_slots.slot() as p_url:
                params = await _prefill(state, p_url, request, body, chat, path, request_id)
            d_body = copy.deepcopy(body)
            d_body["kv_transfer_params"] = params
            return await _decode(state, d_url, request, d_body, path, request_id)
    except Overloaded as e:
        logger.warning("request %s refused: %s", request_id, e)
        return error_response(503, str(e), "server_overloaded")
    except UpstreamError as e:
        logger.warning("request %s failed: %s", request_id, e.message)
        return e.response()


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
        return f"unreachable: {e or type(e).__name__}"


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
    state = request.app[STATE_KEY]
    assert state.session is not None
    url = next(state.models_rr)
    try:
        async with state.session.get(url + "/v1/models", headers=_forward_headers(request, "models")) as resp:
            payload = await resp.read()
            return web.Response(body=payload, status=resp.status,
                                headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
    except (TimeoutError, aiohttp.ClientError) as e:
        return _side_error("decode", url, e).response()


async def handle_stats(request: web.Request) -> web.Response:
    """Admission state: slots in use per server, requests queued, admitted and refused so far."""
    state = request.app[STATE_KEY]
    return web.json_response({"max_inflight": state.config.max_inflight, "max_queued": state.config.max_queued,
                              "prefill": asdict(state.prefill_slots.stats()),
                              "decode": asdict(state.decode_slots.stats())})


def create_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (used by :func:`run` and by the tests)."""
    app = web.Application(client_max_size=256 * 1024 * 1024)
    state = _State(config)
    app[STATE_KEY] = state

    async def open_session(_app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s,
                                        sock_read=config.read_timeout_s)
        # Idle pooled connections are dropped before vLLM's server (uvicorn, 5 s keep-alive) closes them: reusing one
        # it is closing answers "Server disconnected" and fails the request (seen after P was paused and resumed).
        connector = aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        state.session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def close_session(_app: web.Application) -> None:
        if state.session is not None:
            await state.session.close()

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


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(prefill=args.prefill, decode=args.decode, host=args.host, port=args.port,
                       connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
                       health_timeout_s=args.health_timeout, max_inflight=args.max_inflight,
                       max_queued=args.max_queued, queue_timeout_s=args.queue_timeout)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    config = config_from_args(args)
    logger.info("Lynx proxy on http://%s:%s: prefill %s, decode %s", config.host, config.port,
                config.prefill, config.decode)
    web.run_app(create_app(config), host=config.host, port=config.port, print=None,
                access_log=None)
    return 0
