"""The proxy's calls to P and D: what each gets, and how their answers (or failures) come back.

``Call`` tracks one client request (its correlation id, phase, server, and the stream once it is under way).
A call that ends before its answer was read, including one cancelled because the client went away, closes
its connection, so vLLM aborts the request on P or D and frees its blocks.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
from aiohttp import web

from lynx_connector.concurrent import TICKET_REASON_KEY
from lynx_connector.config import REPORT_KEY
from lynx_connector.logger import init_logger
from lynx_connector.proxy_http import (
    REQUEST_ID_HEADER,
    ClientGone,
    Passthrough,
    ProxyError,
    stream_error_event,
    wants_stream,
)
from lynx_connector.trace import trace

logger = init_logger(__name__)

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
FORWARDED_HEADERS = ("Authorization",)  # X-Request-Id: the correlation id, always sent


@dataclass
class Call:
    """Where one request is, for its log lines and for ending a stream that is already under way."""

    request_id: str
    phase: str = "reading the body"
    server: str | None = None
    stream: web.StreamResponse | None = None
    at_event_boundary: bool = True  # the bytes relayed so far end with a whole SSE event
    trace_key: str = ""  # the transfer id, for LYNX_TRACE (lynx_connector/trace.py)

    async def end_stream(self, status: int, message: str) -> web.StreamResponse:
        """Close a stream that failed after its first bytes, as vLLM does: its error event, then [DONE]."""
        assert self.stream is not None
        try:
            if not self.at_event_boundary:
                await self.stream.write(b"\n\n")
            await self.stream.write(stream_error_event(status, message, self.request_id))
            await self.stream.write_eof()
        except ConnectionResetError:
            logger.info("request %s: client gone before the stream's error event", self.request_id)
        return self.stream


def build_prefill_request(body: dict[str, Any], chat: bool, kv_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """P's copy of the request: one token, no streaming, remote decode requested (``kv_params``: the params of
    the pipelined flow, lynx_connector/proxy_flow.py, instead of the sequential ones)."""
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
        # The one key a client may set for P: the transfer mode of this request (P encodes with it, D follows P).
        params["lynx_mode"] = client["lynx_mode"]
    req["kv_transfer_params"] = params if kv_params is None else dict(kv_params)
    return req


def build_decode_request(body: dict[str, Any], p_params: dict[str, Any]) -> dict[str, Any]:
    """D's copy: the client's request with P's params (and ``lynx_report`` when the client asked for it)."""
    req = copy.deepcopy(body)
    client = body.get("kv_transfer_params")
    req["kv_transfer_params"] = dict(p_params)
    if isinstance(client, dict) and client.get(REPORT_KEY) is True:
        req["kv_transfer_params"][REPORT_KEY] = True
    return req


def forward_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
    headers[REQUEST_ID_HEADER] = request_id
    return headers


def transport_error(side: str, url: str, exc: BaseException) -> ProxyError:
    if isinstance(exc, TimeoutError):
        return ProxyError(504, f"{side} server timed out", f"{side} server {url} timed out ({type(exc).__name__})")
    return ProxyError(503, f"{side} server unavailable",
                      f"{side} server {url} unreachable: {type(exc).__name__}: {exc}")


async def _status_error(side: str, url: str, resp: aiohttp.ClientResponse) -> Exception:
    """A non-200 answer: a 4xx is vLLM's verdict on the request (relayed as it came), anything else the
    server's failure (a generic 502)."""
    try:
        body = await resp.read()
    except (TimeoutError, aiohttp.ClientError) as e:
        return transport_error(side, url, e)
    if 400 <= resp.status < 500:
        return Passthrough(side, resp.status, body, resp.headers.get("Content-Type", "application/json"))
    return ProxyError(502, f"{side} server error",
                      f"{side} server {url} answered HTTP {resp.status}: {body[:2000].decode(errors='replace')}")


def clock_ahead_s(date: str | None) -> float | None:
    """How far the clock behind an HTTP ``Date`` header (whole seconds, as uvicorn sends it) is ahead of ours;
    None without a parseable one."""
    try:
        return parsedate_to_datetime(date).timestamp() - time.time() if date else None
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


async def prefill(session: aiohttp.ClientSession, call: Call, url: str, request: web.Request,
                  body: dict[str, Any], chat: bool, kv_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """P's answer's kv_transfer_params (P's 4xx: :class:`Passthrough`; P down or misbehaving: :class:`ProxyError`)."""
    call.phase, call.server = "prefill", url
    try:
        resp = await session.post(url + request.path, json=build_prefill_request(body, chat, kv_params),
                                  headers=forward_headers(request, call.request_id))
    except (TimeoutError, aiohttp.ClientError) as e:
        raise transport_error("prefill", url, e) from e
    try:
        if resp.status != 200:
            raise await _status_error("prefill", url, resp)
        try:
            answer = json.loads(await resp.read())
        except (TimeoutError, aiohttp.ClientError) as e:
            raise transport_error("prefill", url, e) from e
        except (ValueError, RecursionError) as e:
            raise ProxyError(502, "prefill server error", f"prefill server {url} returned invalid JSON: {e}") from e
    except BaseException:
        resp.close()  # an unfinished answer (or a cancelled call): the connection goes, vLLM aborts the request
        raise
    resp.release()
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or not params:
        raise ProxyError(502, "prefill server returned no kv_transfer_params",
                         f"prefill server {url} returned no kv_transfer_params; is it running with a KV connector "
                         "(e.g. --kv-transfer-config lynx)?")
    error = params.get("lynx_error")
    if isinstance(error, dict) and not params.get("do_remote_prefill"):
        # P refused the request's Lynx parameters (e.g. a lynx_mode the operator does not allow): the client's
        # fault, in vLLM's error fields, relayed as vLLM would answer it
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code < 500 else 400
        reason = error.get(TICKET_REASON_KEY) if error.get("param") == "kv_transfer_params" else None
        raise Passthrough("prefill", status, json.dumps({"error": error}).encode(), "application/json",
                          ticket_refused=reason if isinstance(reason, str) else None,
                          peer_clock_ahead_s=clock_ahead_s(resp.headers.get("Date")))
    logger.debug("request %s prefilled on %s: kv_transfer_params keys %s", call.request_id, url,
                 sorted(params))  # not the values: the transfer token and the signature are secrets
    return params


async def decode(session: aiohttp.ClientSession, call: Call, url: str, request: web.Request,
                 body: dict[str, Any], gate: Callable[[], Awaitable[None]] | None = None) -> web.StreamResponse:
    """D's answer for the client: its body, or its stream relayed as it arrives. ``gate`` (pipelined flow) is
    awaited before the first byte reaches the client; it raises to refuse the answer (P refused the request)."""
    call.phase, call.server = "decode", url
    try:
        resp = await session.post(url + request.path, json=body,
                                  headers=forward_headers(request, call.request_id))
    except (TimeoutError, aiohttp.ClientError) as e:
        raise transport_error("decode", url, e) from e
    try:
        if resp.status != 200:
            raise await _status_error("decode", url, resp)
        content_type = resp.headers.get("Content-Type", "application/json")
        if not wants_stream(body):
            try:
                payload = await resp.read()
            except (TimeoutError, aiohttp.ClientError) as e:
                raise transport_error("decode", url, e) from e
            if gate is not None:
                await gate()
            out: web.StreamResponse = web.Response(body=payload, status=200, headers={"Content-Type": content_type})
        else:
            out = await _relay_stream(call, request, resp, content_type, gate)
    except BaseException:
        resp.close()  # D sees the connection close and aborts the request (its blocks are freed)
        raise
    resp.release()
    return out


async def _relay_stream(call: Call, request: web.Request, resp: aiohttp.ClientResponse, content_type: str,
                        gate: Callable[[], Awaitable[None]] | None = None) -> web.StreamResponse:
    if gate is not None:  # nothing reaches the client before the gate opens
        try:
            first = await resp.content.readany()
        except (TimeoutError, aiohttp.ClientError) as e:  # D failed before its first byte: as a non-stream read
            raise transport_error("decode", call.server or "decode server", e) from e
        trace("proxy", call.trace_key or call.request_id, "d_first_bytes")
        await gate()
        trace("proxy", call.trace_key or call.request_id, "gate_open")
    else:
        first = None
    out = web.StreamResponse(status=200, headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
    await out.prepare(request)
    call.stream, call.phase = out, "decode stream"
    while True:
        try:
            chunk, first = (first, None) if first is not None else (await resp.content.readany(), None)
        except (TimeoutError, aiohttp.ClientError) as e:
            logger.warning("request %s: decode server %s failed mid-stream: %s: %s", call.request_id, call.server,
                           type(e).__name__, e)
            resp.close()
            if isinstance(e, TimeoutError):  # silent for --read-timeout: a timeout, as before the stream began
                return await call.end_stream(504, "decode server timed out mid-stream")
            return await call.end_stream(502, "decode server failed mid-stream")
        if not chunk:
            break
        try:
            await out.write(chunk)
        except ConnectionResetError as e:  # aiohttp's ClientConnectionResetError is one
            raise ClientGone() from e
        call.at_event_boundary = chunk.endswith(b"\n\n")
    try:
        await out.write_eof()
    except ConnectionResetError as e:
        raise ClientGone() from e
    return out
