"""Signed ``kv_transfer_params`` (issue 14.6, docs/PROTOCOL.md section 5): D trusts only its prefill instances.

P's scheduler half signs the remote-prefill params it returns: ``lynx_sig`` = HMAC-SHA256 over the canonical JSON
of every key D reads (:data:`SIGNED_KEYS`: where to pull from, what, the capability, the mode, the counts, a
digest of the prompt and an expiry time), with the deployment key of the side channel. D's scheduler half accepts
remote-prefill params only when the signature verifies and has not expired; a client of D's HTTP API therefore
cannot make D connect anywhere, nor load KV for a prompt other than the one P computed. A router that relays
P's params unchanged (vllm-router, ``lynx proxy``) keeps working: keys outside :data:`SIGNED_KEYS` (vLLM adds
``remote_prefill_cached_tokens`` on P) are neither signed nor read.

Canonical form: the JSON object of the signed keys present, sorted, no whitespace, ASCII, no NaN; values are what
JSON carries unchanged through any relay (strings, integers, booleans, lists of integers, null). The MAC covers
``"lynx/params/v2" NUL | canonical``. Without a key (``insecure_side_channel``) the empty key signs: anyone can
then forge params, as anyone can then talk to P's side channel.

Pure Python (no vLLM, no torch): unit-testable anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import sys
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lynx_connector.auto import AUTO_KEY
from lynx_connector.concurrent import FLOW_KEY
from lynx_connector.fanout import CHILDREN_KEY, MAX_CHILDREN
from lynx_connector.logger import init_logger

logger = init_logger(__name__)

HEX_DIGITS = "0123456789abcdef"  # what _mac's hexdigest writes

__all__ = ["EXPIRES_KEY", "PROMPT_KEY", "REFUSAL_REASONS", "SIGNED_KEYS", "SIG_KEY", "ParamsRefused",
           "ParamsSigner", "RefusalLog", "canonical", "check_prompt", "prompt_digest"]

SIG_KEY = "lynx_sig"
EXPIRES_KEY = "lynx_expires"
PROMPT_KEY = "lynx_prompt_sha"
#: Every key of the remote-prefill params D reads (``lynx_connector.metadata.RemotePrefill``), plus the expiry.
SIGNED_KEYS: tuple[str, ...] = (
    "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
    "lynx_ports", "remote_num_tokens", "lynx_mode", "lynx_version", "lynx_transfer_id", "lynx_token", "lynx_first_token",
    "lynx_kv_dtype", FLOW_KEY, AUTO_KEY, CHILDREN_KEY, PROMPT_KEY, EXPIRES_KEY,
)
#: Why D refused remote-prefill params (the ``reason`` label of ``vllm:lynx_refused_params``).
REFUSAL_REASONS: tuple[str, ...] = ("unsigned", "bad_signature", "expired", "malformed", "mode_not_allowed",
                                    "prompt_mismatch", "replayed")
_DOMAIN = b"lynx/params/v2\x00"
_MAX_STR = 1024
_MAX_LIST = 1024


class ParamsRefused(ValueError):
    """Remote-prefill params D does not accept; ``reason`` is one of :data:`REFUSAL_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REFUSAL_REASONS, reason
        super().__init__(message)
        self.reason = reason


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 (hex) of the prompt's token ids (8-byte little-endian each): binds the params to the prompt."""
    arr = array("q", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return hashlib.sha256(arr.tobytes()).hexdigest()


def _plain(value: Any) -> bool:
    """A value that crosses any JSON relay unchanged and is small (checked before it is serialized)."""
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) < 2**53
    if isinstance(value, str):
        return len(value) <= _MAX_STR
    if isinstance(value, list):
        return len(value) <= _MAX_LIST and all(isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**53
                                               for v in value)
    return False


def _plain_children(value: Any) -> bool:
    """``lynx_children`` (n > 1, lynx_connector/fanout.py): a bounded list of flat dicts of plain scalars."""
    return isinstance(value, list) and len(value) <= MAX_CHILDREN and all(
        isinstance(e, dict) and len(e) <= 8 and all(isinstance(k, str) and _plain(v) and not isinstance(v, list)
                                                    for k, v in e.items())
        for e in value)


def canonical(params: Mapping[str, Any]) -> bytes:
    """The signed content: the JSON of the signed keys present (:class:`ParamsRefused` ``malformed`` when a
    value is not a plain JSON scalar or a list of integers, or for ``lynx_children`` a list of flat dicts of
    scalars)."""
    signed = {}
    for key in SIGNED_KEYS:
        if key in params:
            if not (_plain_children if key == CHILDREN_KEY else _plain)(params[key]):
                raise ParamsRefused("malformed", f"{key} is not a plain JSON value of the expected size")
            signed[key] = params[key]
    return json.dumps(signed, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


class ParamsSigner:
    """Signs (P) and verifies (D) remote-prefill params with the deployment key (``None``: insecure, the empty
    key). ``ttl_s``: how long signed params stay valid; ``clock``: wall-clock seconds (P and D compare times)."""

    def __init__(self, key: bytes | None, ttl_s: float, clock: Callable[[], float] = time.time,
                 extra_keys: tuple[bytes, ...] = ()) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self._key = key if key is not None else b""
        self._extra_keys = extra_keys  # a key rotation's other key: accepted, never signed with
        self.ttl_s = float(ttl_s)
        self._clock = clock

    def _mac(self, params: Mapping[str, Any], key: bytes | None = None) -> str:
        return hmac.new(self._key if key is None else key, _DOMAIN + canonical(params), hashlib.sha256).hexdigest()

    def sign(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with ``lynx_expires`` (integer seconds since the epoch) and ``lynx_sig`` added."""
        out = {k: v for k, v in params.items() if k not in (SIG_KEY, EXPIRES_KEY)}
        out[EXPIRES_KEY] = math.ceil(self._clock() + self.ttl_s)
        out[SIG_KEY] = self._mac(out)
        return out

    def verify(self, params: Mapping[str, Any], at: float | None = None) -> None:
        """Accept ``params`` or raise :class:`ParamsRefused`: unsigned, a bad signature (any signed key added,
        removed or changed, another key), malformed, or expired (at wall-clock time ``at``: now when None)."""
        sig = params.get(SIG_KEY)
        if sig is None:
            raise ParamsRefused("unsigned", "remote-prefill params carry no lynx_sig: only a prefill instance of "
                                            "this deployment can produce them")
        if not isinstance(sig, str) or len(sig) != 64 or not sig.isascii() or sig.strip(HEX_DIGITS):
            raise ParamsRefused("bad_signature", "lynx_sig is not a 64-character hex string")
        if not any([hmac.compare_digest(self._mac(params, key), sig) for key in (self._key, *self._extra_keys)]):
            raise ParamsRefused("bad_signature", "lynx_sig does not verify: the params were changed or signed "
                                                 "with another deployment key")
        expires = params.get(EXPIRES_KEY)
        if not isinstance(expires, int) or isinstance(expires, bool):
            raise ParamsRefused("malformed", f"{EXPIRES_KEY} missing or not an integer")
        now = self._clock() if at is None else at
        if now > expires:  # the signer's lifetime, not ours: the proxy signs with its own --params-ttl
            raise ParamsRefused("expired", f"the params expired {now - expires:.0f} s ago (their lifetime is the "
                                           "signer's: params_ttl_s of the prefill instance, --params-ttl of lynx "
                                           "proxy; are the clocks of the proxy, prefill and decode hosts in sync?)")


def check_prompt(params: Mapping[str, Any], prompt_ids: Sequence[int] | None, num_tokens: int) -> None:
    """The params are for this prompt: P's digest of its prompt (``lynx_prompt_sha``, signed) equals the digest
    of D's first ``num_tokens`` prompt tokens; :class:`ParamsRefused` ``prompt_mismatch`` otherwise. P signs no
    digest when it had no token ids (prompt embeddings): nothing to bind to then."""
    digest = params.get(PROMPT_KEY)
    if digest is None:
        return
    if (prompt_ids is None or len(prompt_ids) < num_tokens or not isinstance(digest, str)
            or not hmac.compare_digest(prompt_digest(prompt_ids[:num_tokens]), digest)):
        raise ParamsRefused("prompt_mismatch", "the params were signed for another prompt")


class RefusalLog:
    """Warnings about refused params (and requests P refuses): at most one per ``every_s`` per reason (a flood of
    forged requests must not flood the log), with the number suppressed since the last one."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, req_id: str, exc: ParamsRefused, what: str = "remote-prefill params",
             outcome: str = "computing its prompt locally") -> bool:
        """Log it unless one of its reason was logged less than ``every_s`` ago; True when logged."""
        return self.note(req_id, exc.reason, str(exc), what, outcome)

    def note(self, req_id: str, reason: str, message: str, what: str, outcome: str) -> bool:
        """:meth:`warn` for any refusal of a request (``reason``: its rate-limit key, e.g. P's ``too_large``)."""
        now = self._clock()
        if now - self._last.get(reason, -math.inf) < self._every_s:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return False
        self._last[reason] = now
        more = self._suppressed.pop(reason, 0)
        logger.warning("Request %s: %s refused (%s: %s); %s%s", req_id[:128], what, reason, message[:300], outcome,
                       f" ({more} more refused for this reason since the last warning)" if more else "")
        return True
