"""Side-channel wire protocol (zmq ROUTER on P, DEALER on D): versioned msgpack messages via msgspec.

Every frame from the network is size-checked before decoding, decoded into a closed set of typed messages
(msgspec validates field types and ranges), and version-checked; anything else raises `ProtocolError`.
Nothing is ever unpickled. One message per zmq frame (DEALER sends [payload]; ROUTER sees [identity, payload]).

  D -> P  Hello(compat)          P -> D  HelloOk(agent metadata, pool descriptor, compat hash) | Error
  D -> P  Query(req_id)          P -> D  Regions(req_id, offsets, sizes) | NotReady(req_id) | Error
  D -> P  Done(req_id)           P -> D  Ack(req_id)
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

import msgspec

__all__ = [
    "VERSION", "ProtocolError", "Hello", "HelloOk", "Query", "Regions", "NotReady", "Done", "Ack", "Error",
    "Message", "encode", "decode", "compat_hash", "compat_diff",
]

VERSION = 1
MAX_ID = 512
MAX_MD = 1 << 20
U64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
I64 = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]
ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID)]
Ver = Annotated[int, msgspec.Meta(ge=0, le=65535)]
CompatValue = str | int | float | bool | None
Compat = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], CompatValue], msgspec.Meta(max_length=64)]


class ProtocolError(ValueError):
    """A side-channel message failed validation."""


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    v: Ver


class Hello(_Msg, tag="hello"):
    compat: Compat


class HelloOk(_Msg, tag="hello_ok"):
    agent_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID)]
    agent_md: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_MD)]
    pool_addr: U64
    pool_nbytes: U64
    compat_hash: Annotated[str, msgspec.Meta(min_length=64, max_length=64)]


class Query(_Msg, tag="query"):
    req_id: ReqId


class Regions(_Msg, tag="regions"):
    req_id: ReqId
    anchor_offset: U64
    anchor_nbytes: U64
    residual_offset: I64
    residual_nbytes: U64


class NotReady(_Msg, tag="not_ready"):
    req_id: ReqId


class Done(_Msg, tag="done"):
    req_id: ReqId


class Ack(_Msg, tag="ack"):
    req_id: ReqId


class Error(_Msg, tag="error"):
    code: Annotated[str, msgspec.Meta(max_length=64)]
    message: Annotated[str, msgspec.Meta(max_length=4096)]
    req_id: Annotated[str, msgspec.Meta(max_length=MAX_ID)] = ""


Message = Hello | HelloOk | Query | Regions | NotReady | Done | Ack | Error

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes, max_bytes: int) -> Message:
    """Validate and decode one frame; raises `ProtocolError` with a reason."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    try:
        msg = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed message: {exc}") from None
    if msg.v != VERSION:
        raise ProtocolError(f"unsupported protocol version {msg.v} (this side speaks {VERSION})")
    return msg


def compat_hash(compat: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a compatibility dict (model, layers, heads, head size, dtype, codec...)."""
    canon = json.dumps(compat, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()


def compat_diff(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Human-readable differences, one per field: `name: ours=X theirs=Y`."""
    missing = object()
    out = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key, missing), theirs.get(key, missing)
        if a != b or type(a) is not type(b):
            fa = "<missing>" if a is missing else repr(a)
            fb = "<missing>" if b is missing else repr(b)
            out.append(f"{key}: ours={fa} theirs={fb}")
    return out
