"""The proxy's own HTTP answers: errors in vLLM's shape and the per-request correlation id; its listening socket.

vLLM's OpenAI server answers errors with ``{"error": {"message", "type", "param", "code"}}`` (``ErrorResponse`` in
``vllm/entrypoints/serve/engine/protocol.py``; its HTTP-level handlers use the status phrase as ``type``), as
compact JSON, and inside a stream as ``data: {...}`` followed by ``data: [DONE]``. The errors the proxy itself
produces (a P or D down or misbehaving, a deadline, an overload, a bad body) use the same shape: a generic
message naming the side and ending with the correlation id, no URL, no exception text; the details go to the
proxy's log under the same id. vLLM's own error bodies from P or D are not built here: they are relayed as they
came (:class:`Passthrough`).
"""

from __future__ import annotations

import json
import re
import resource
import socket
import uuid
from http import HTTPStatus
from typing import Any

from aiohttp import web

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
#: A client's X-Request-Id is kept when it is at most this long and made only of ``[A-Za-z0-9._:-]``.
MAX_REQUEST_ID_LEN = 128
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]+")


def correlation_id(client_id: str | None) -> tuple[str, str | None]:
    """The request's correlation id: the client's ``X-Request-Id`` when it is bounded, else a fresh
    ``lynx-<hex>``; and why the client's was not taken (None when it was, or when there was none)."""
    if client_id is not None:
        if len(client_id) > MAX_REQUEST_ID_LEN:
            return _fresh_id(), f"longer than {MAX_REQUEST_ID_LEN} characters ({len(client_id)})"
        if not _REQUEST_ID_RE.fullmatch(client_id):
            return _fresh_id(), "characters outside [A-Za-z0-9._:-]" if client_id else "empty"
        return client_id, None
    return _fresh_id(), None


#: The deepest nesting of JSON arrays and objects a request body may have. The proxy copies the body for P and D
#: (``copy.deepcopy``, two Python frames a level): a body nested some 500 deep overflowed the stack there, past
#: the parse. Real bodies (chat content parts, tool and response_format JSON schemas) stay far below this.
MAX_JSON_DEPTH = 128


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON ``value`` nests arrays and objects deeper than ``limit`` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children and depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def wants_stream(body: dict[str, Any]) -> bool:
    """Whether vLLM streams its answer to ``body``: its request model reads ``stream`` as pydantic reads a bool, so
    the strings ``"false"``, ``"0"``, ``"no"``... are False (a truthiness test streamed them)."""
    value = body.get("stream")
    if isinstance(value, str):
        return value.strip().lower() in ("1", "on", "t", "true", "y", "yes")
    return bool(value)


def _fresh_id() -> str:
    return f"lynx-{uuid.uuid4().hex}"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": HTTPStatus(status).phrase, "param": None, "code": status}}


def error_response(status: int, message: str, request_id: str) -> web.Response:
    """A JSON error as vLLM's server writes one (compact separators); the message ends with the request id."""
    body = json.dumps(error_body(status, f"{message} (request id: {request_id})"), ensure_ascii=False,
                      separators=(",", ":"))
    return web.Response(text=body, status=status, content_type="application/json")


def stream_error_event(status: int, message: str, request_id: str) -> bytes:
    """The end of a stream that failed after its first bytes: vLLM's error event, then ``[DONE]``."""
    event = json.dumps(error_body(status, f"{message} (request id: {request_id})"))
    return f"data: {event}\n\ndata: [DONE]\n\n".encode()


class ProxyError(Exception):
    """An answer the proxy produces itself: ``message`` goes to the client, ``detail`` to the log only."""

    def __init__(self, status: int, message: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.message = message
        self.detail = detail

    def response(self, request_id: str) -> web.Response:
        return error_response(self.status, self.message, request_id)


def _error_kind(body: bytes) -> str:
    """`` (BadRequestError, param x)`` from a vLLM error body: what a log may say of it (its message may quote
    the prompt)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    if not isinstance(error, dict):
        return ""
    kind = [str(error[k])[:80] for k in ("type",) if error.get(k)]
    kind += [f"param {str(error['param'])[:80]}"] if error.get("param") else []
    return f" ({', '.join(kind)})" if kind else ""


class Passthrough(Exception):
    """A P or D error answer (4xx) relayed to the client unchanged: status, body bytes and content type."""

    def __init__(self, side: str, status: int, body: bytes, content_type: str,
                 ticket_refused: str | None = None, peer_clock_ahead_s: float | None = None) -> None:
        super().__init__(f"{side} answered HTTP {status}{_error_kind(body)}")
        self.side = side
        self.status = status
        self.body = body
        self.content_type = content_type
        #: P refused the proxy's own concurrent-flow ticket, and why (P's ``lynx_reason``): not the client's fault
        self.ticket_refused = ticket_refused
        #: how far P's clock (its HTTP ``Date`` header, whole seconds) was ahead of the proxy's when it answered
        self.peer_clock_ahead_s = peer_clock_ahead_s

    def response(self) -> web.Response:
        return web.Response(body=self.body, status=self.status, headers={"Content-Type": self.content_type})


class ClientGone(Exception):
    """The client closed its connection while the proxy was writing to it."""


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: a free port), IPv4 or IPv6 as ``host`` resolves."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


def raise_fd_limit(target: int = 65535) -> None:
    """Raise this process's soft limit on open files toward ``target`` (at most the hard limit), as vLLM does
    for its servers: every request in flight holds a client connection and up to two upstream ones."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as exc:
            logger.warning("Lynx proxy: open-file limit %d could not be raised to %d (%s): at most about %d "
                           "requests in flight", soft, want, exc, soft // 3)
