"""Side-channel wire protocol v4 (zmq ROUTER on P, DEALER on D): versioned msgpack messages via msgspec,
an HMAC handshake over the deployment key and a MAC on every frame of a session (docs/PROTOCOL.md 1 and 2).

Every frame from the network is size-checked before decoding, decoded into a closed set of typed messages
(msgspec validates field types and ranges), and version-checked; anything else raises `ProtocolError`.
Nothing is ever unpickled. One message per zmq frame (DEALER sends [payload]; ROUTER sees [identity, payload]).

  D -> P  Hello(nonce_d, compat_hash)                      P -> D  Challenge(nonce_p, proof_p)  | Error
  D -> P  Auth(proof_d, compat, resume)        (sealed)    P -> D  HelloOk(agent md, pool, session_id) (sealed)
  D -> P  Query(transfer_id, token)            (sealed)    P -> D  Regions | NotReady | Error      (sealed)
                                    (Regions names how much of each region is ready: layer-wise publish,
                                     P's first token once sampled: concurrent flow, and the transfer mode
                                     P staged it under: v3, for auto in the concurrent flow)
  D -> P  Done(transfer_id, token, link_s, link_bytes) (sealed) P -> D  Ack | Error               (sealed)
                                    (link_s, link_bytes: the link time D's reads of the transfer took and the
                                     bytes they read: v4, P's measured link for auto)
  D -> P  KeepAlive([(transfer_id, token)...]) (sealed)    P -> D  Alive(gone)                    (sealed)
                                                           P -> D  Error("closing")               (sealed)
                                    (unasked, to every session when P shuts down: D fails its pulls from P
                                     at once instead of at their deadline, and owes P no Done; section 9)

Hello, Challenge and any Error to a peer without a session are plain msgpack. Every other frame is *sealed*
(`seal`/`Opener`): ``0xC1 | payload | seq (u64, big endian) | HMAC(S, direction | seq | payload)[:16]`` with
the session key ``S`` of the handshake (0xC1 is never the first byte of a msgpack message).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import threading
import time
from collections.abc import Collection
from typing import Annotated, Any

import msgspec

from lynx_connector.limits import MAX_SECONDS

__all__ = [
    "VERSION", "ProtocolError", "VersionMismatch", "Hello", "Challenge", "Auth", "HelloOk", "Query", "Regions", "NotReady", "Done",
    "Ack", "Error", "KeepAlive", "Alive", "Message", "encode", "decode", "compat_hash", "compat_hash_for", "compat_diff", "LATER_COMPAT_FIELDS", "proof_p", "proof_d",
    "session_key", "seal", "Opener", "SEALED", "MAX_KEEPALIVE", "MAX_TOKEN_ID", "P_TO_D", "D_TO_P", "HEX_ID_LEN", "is_hex_id",
    "is_mode_name", "CLOSING", "MIN_MESSAGE_BYTES",
]

VERSION = 4  # v3: Regions names the transfer mode (auto in the concurrent flow); v4: Done carries link_s (PROTOCOL.md 7, 8)
MAX_ID = 512
MAX_MD = 1 << 20
HEX_ID_LEN = 32  # transfer ids and tokens: 16 random bytes, hex
MAX_TOKEN_ID = 1 << 31  # Regions.first_token is a token id below this
U64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
I64 = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]
HexId = Annotated[str, msgspec.Meta(min_length=HEX_ID_LEN, max_length=HEX_ID_LEN, pattern="^[0-9a-f]+$")]
ModeName = Annotated[str, msgspec.Meta(max_length=32, pattern="^[a-z0-9_]*$")]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
Mac32 = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Ver = Annotated[int, msgspec.Meta(ge=0, le=65535)]
#: The code of the Error P sends, unasked and sealed, to every session when it shuts down (docs/PROTOCOL.md
#: section 9). An Error with no transfer id already ended a v4 peer's session, so it needs no new version.
CLOSING = "closing"
MAX_KEEPALIVE = 256  # tickets per KeepAlive frame (about 70 bytes each: far below the 64 KiB frame cap)
#: The smallest inbound-frame limit (`TransportConfig.max_message_bytes`) an end may have: a sealed KeepAlive of
#: MAX_KEEPALIVE tickets (about 17.7 KB) must fit, or P refuses D's lease renewals.
MIN_MESSAGE_BYTES = 32 << 10
CompatValue = str | int | float | bool | None
#: Compat fields added after protocol v4 was first released (lynx_connector/compat.py). D sends them; P compares
#: each one D sent and does not require them, so a D of an earlier release still passes a P of this one (upgrade
#: P's first: an earlier P refuses a D that sends a field it does not know, naming it). P's HelloOk hash then
#: covers the fields D sent (:func:`compat_hash_for`).
LATER_COMPAT_FIELDS: tuple[str, ...] = ("model_revision", "rope")
Compat = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], CompatValue], msgspec.Meta(max_length=64)]

SEALED = 0xC1
P_TO_D = b"p"
D_TO_P = b"d"
_SEQ = struct.Struct(">Q")
TAG_BYTES = 16
SEAL_OVERHEAD = 1 + _SEQ.size + TAG_BYTES


def is_hex_id(value: object) -> bool:
    """A transfer id or token: exactly 32 lower-case hex characters."""
    return (isinstance(value, str) and len(value) == HEX_ID_LEN
            and all(c in "0123456789abcdef" for c in value))


def is_mode_name(value: object) -> bool:
    """A value ``Regions.mode`` / ``Regions.auto_reason`` can carry (the `ModeName` constraint)."""
    try:
        msgspec.convert(value, ModeName)
    except msgspec.ValidationError:
        return False
    return True


class ProtocolError(ValueError):
    """A side-channel message failed validation."""


class VersionMismatch(ProtocolError):
    """A msgpack map whose ``v`` is another protocol version (``version``; ``kind``: its ``type`` when a string):
    a peer of another release, or anybody who writes such a map (nothing else of it is checked)."""

    def __init__(self, version: int, kind: str | None = None):
        super().__init__(f"unsupported protocol version {version} (this side speaks {VERSION})")
        self.version, self.kind = version, kind


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    v: Ver


class Hello(_Msg, tag="hello"):
    nonce_d: Nonce
    compat_hash: Annotated[str, msgspec.Meta(min_length=64, max_length=64)]


class Challenge(_Msg, tag="challenge"):
    nonce_p: Nonce
    proof_p: Mac32


class Auth(_Msg, tag="auth"):
    proof_d: Mac32
    compat: Compat
    #: session_id of D's previous session with this P (after a reconnect): its transfers stay D's.
    resume: Annotated[bytes, msgspec.Meta(max_length=16)] = b""


class HelloOk(_Msg, tag="hello_ok"):
    agent_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID)]
    agent_md: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_MD)]
    pool_addr: U64
    pool_nbytes: U64
    compat_hash: Annotated[str, msgspec.Meta(min_length=64, max_length=64)]
    session_id: Nonce
    #: P's lease: D renews the requests it pulls (KeepAlive) every quarter of it.
    lease_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]


class Query(_Msg, tag="query"):
    transfer_id: HexId
    token: HexId


class Regions(_Msg, tag="regions"):
    transfer_id: HexId
    anchor_offset: U64
    anchor_nbytes: U64
    residual_offset: I64
    residual_nbytes: U64
    #: This tenancy of the regions (P's pool allocation counter); it seeds every layer's checksum, so bytes of
    #: any other tenancy of the same regions fail D's check.
    generation: U64
    #: Pipelined transfer (docs/PROTOCOL.md section 6): how many leading bytes of each region P has encoded and
    #: sealed so far (whole layers, in layer order); ``ALL`` (-1) = the whole region. D reads only what is ready
    #: and queries again for the rest.
    anchor_ready: I64 = -1
    residual_ready: I64 = -1
    #: The token P sampled after the prompt (at full precision), once P's scheduler has told its worker: -1 =
    #: not known yet. A speculative D of the concurrent flow asks until it is known (docs/PROTOCOL.md section
    #: 6); D ignores a value outside ``[0, 2**31)``.
    first_token: I64 = -1
    #: The transfer mode P staged the request under (``lynx_connector/modes.py``: the one it was asked for, or
    #: the one its ``auto`` chose) and, for an auto choice, why (``lynx_connector.auto.AUTO_REASONS``). A D that
    #: let P choose (auto in the concurrent flow, docs/PROTOCOL.md section 7) sizes its staging by it; "" = not
    #: named (a P that stages without a mode: D then checks the sizes only).
    mode: ModeName = ""
    auto_reason: ModeName = ""


class NotReady(_Msg, tag="not_ready"):
    transfer_id: HexId


class Done(_Msg, tag="done"):
    transfer_id: HexId
    token: HexId
    #: The link time D's reads of this transfer took and the bytes they read (docs/PROTOCOL.md section 8): each
    #: moment a chunk of it was in flight counts in proportion to its share of D's bytes in flight then, so that
    #: D's transfers share its busy time without counting it twice. 0 = not measured (the pull did not
    #: complete: failed, abandoned).
    link_s: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 0.0
    link_bytes: U64 = 0


class KeepAlive(_Msg, tag="keep_alive"):
    """Renews P's lease of each transfer D is pulling (queued or in flight)."""

    tickets: Annotated[list[tuple[HexId, HexId]], msgspec.Meta(min_length=1, max_length=MAX_KEEPALIVE)]


class Alive(_Msg, tag="alive"):
    """P's answer to a KeepAlive: the transfer ids it no longer holds for this session (the rest are renewed)."""

    gone: Annotated[list[HexId], msgspec.Meta(max_length=MAX_KEEPALIVE)]


class Ack(_Msg, tag="ack"):
    transfer_id: HexId


class Error(_Msg, tag="error"):
    code: Annotated[str, msgspec.Meta(max_length=64)]
    message: Annotated[str, msgspec.Meta(max_length=4096)]
    transfer_id: Annotated[str, msgspec.Meta(max_length=HEX_ID_LEN)] = ""


Message = Hello | Challenge | Auth | HelloOk | Query | Regions | NotReady | Done | KeepAlive | Alive | Ack | Error

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes, max_bytes: int) -> Message:
    """Validate and decode one plain frame (or a sealed frame's payload); raises `ProtocolError` with a reason."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    try:
        msg = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        version, kind = _peek_version(frame)
        if version is not None and version != VERSION:
            raise VersionMismatch(version, kind) from None
        raise ProtocolError(f"malformed message: {exc}") from None
    if msg.v != VERSION:
        raise VersionMismatch(msg.v, msg.__struct_config__.tag)
    return msg


def _peek_version(frame: bytes) -> tuple[int | None, str | None]:
    """The ``v`` and ``type`` of a frame that is a msgpack map but not a valid message of this version (an older
    or newer peer), else None for either."""
    try:
        obj = msgspec.msgpack.decode(frame)
    except Exception:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    v, kind = obj.get("v"), obj.get("type")
    return (v if isinstance(v, int) and not isinstance(v, bool) else None), (kind if isinstance(kind, str) else None)


# ---- handshake and sealed frames ------------------------------------------------------------------
_MAC_TIME = threading.local()


def _mac(key: bytes, *parts: bytes) -> bytes:
    t0 = time.perf_counter()
    out = hmac.new(key, b"".join(parts), hashlib.sha256).digest()
    _MAC_TIME.s = getattr(_MAC_TIME, "s", 0.0) + time.perf_counter() - t0
    return out


def mac_seconds() -> float:
    """Seconds the calling thread has spent computing side-channel MACs (handshake proofs, sealing and opening
    frames): the authentication's cost, exported as ``vllm:lynx_security_seconds{what="mac"}``."""
    return getattr(_MAC_TIME, "s", 0.0)


def proof_p(key: bytes, nonce_d: bytes, nonce_p: bytes) -> bytes:
    """P's proof of the deployment key: HMAC(K, "lynx/p" | nonce_d | nonce_p)."""
    return _mac(key, b"lynx/p", nonce_d, nonce_p)


def proof_d(key: bytes, nonce_d: bytes, nonce_p: bytes) -> bytes:
    """D's proof of the deployment key: HMAC(K, "lynx/d" | nonce_p | nonce_d)."""
    return _mac(key, b"lynx/d", nonce_p, nonce_d)


def session_key(key: bytes, nonce_d: bytes, nonce_p: bytes) -> bytes:
    """S = HMAC(K, "lynx/session" | nonce_d | nonce_p)."""
    return _mac(key, b"lynx/session", nonce_d, nonce_p)


def seal(skey: bytes, direction: bytes, seq: int, payload: bytes) -> bytes:
    """A sealed frame: 0xC1 | payload | seq | HMAC(S, direction | seq | payload)[:16]."""
    s = _SEQ.pack(seq)
    return bytes([SEALED]) + payload + s + _mac(skey, direction, s, payload)[:TAG_BYTES]


class Opener:
    """Checks the sealed frames of one direction of a session: MAC, then a strictly increasing seq."""

    def __init__(self, skey: bytes, direction: bytes) -> None:
        self._key, self._dir = skey, direction
        self.last_seq = 0

    def open(self, frame: bytes) -> tuple[str, bytes]:
        """("ok", payload), ("bad_mac", b"") or ("replayed", b"") (an old or repeated seq)."""
        if len(frame) < SEAL_OVERHEAD or frame[0] != SEALED:
            return "bad_mac", b""
        payload, s, tag = frame[1:-TAG_BYTES - _SEQ.size], frame[-TAG_BYTES - _SEQ.size:-TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(tag, _mac(self._key, self._dir, s, payload)[:TAG_BYTES]):
            return "bad_mac", b""
        seq = _SEQ.unpack(s)[0]
        if seq <= self.last_seq:
            return "replayed", b""
        self.last_seq = seq
        return "ok", bytes(payload)


def compat_hash(compat: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a compatibility dict (model, layers, heads, head size, dtype, codec...)."""
    canon = json.dumps(compat, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()


def compat_hash_for(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """The compat hash P answers a D with: of P's fields, those :data:`LATER_COMPAT_FIELDS` D did not send left
    out, so a D of an earlier release finds the hash of its own fields (when they match)."""
    return compat_hash({k: v for k, v in ours.items() if k in theirs or k not in LATER_COMPAT_FIELDS})


def compat_diff(ours: dict[str, Any], theirs: dict[str, Any], optional: Collection[str] = ()) -> list[str]:
    """Human-readable differences, one per field: `name: ours=X theirs=Y`. A field of ``optional`` that
    ``theirs`` lacks is not compared (a peer of an earlier release: :data:`LATER_COMPAT_FIELDS`)."""
    missing = object()
    out = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key, missing), theirs.get(key, missing)
        if b is missing and key in optional:
            continue
        if a != b or type(a) is not type(b):
            fa = "<missing>" if a is missing else repr(a)
            fb = "<missing>" if b is missing else repr(b)
            out.append(f"{key}: ours={fa} theirs={fb}")
    return out
