"""The deployment key of the side channel (docs/PROTOCOL.md section 1), read once at start-up.

``LYNX_SIDE_CHANNEL_KEY_FILE`` names a file holding the key (a k8s Secret mounted as a file: raw bytes, or hex
text: whitespace and a leading ``0x`` ignored), ``LYNX_SIDE_CHANNEL_KEY`` holds it as hex (read the same way); at
least 32 bytes. The file wins when both are set. Without a usable key start-up fails with `SideChannelKeyError`,
naming both variables; the only way to run without one is ``insecure_side_channel: true`` in
``kv_connector_extra_config`` (local tests), logged as a warning.

Key rotation (docs/OPERATIONS.md, "Rotating the deployment key"): ``LYNX_SIDE_CHANNEL_EXTRA_KEY_FILE`` /
``LYNX_SIDE_CHANNEL_EXTRA_KEY`` (read the same way) name one more key that this instance accepts: D accepts a P
that proves it in the handshake (and answers that P in it for that session), and whoever verifies signed
``kv_transfer_params`` accepts its signature. P proves, and every instance signs, with the deployment key only.
"""

from __future__ import annotations

import os
import string
from collections.abc import Mapping

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

__all__ = ["EXTRA_KEY_ENV", "EXTRA_KEY_FILE_ENV", "KEY_ENV", "KEY_FILE_ENV", "MIN_KEY_BYTES", "SideChannelKeyError",
           "load_extra_keys", "load_side_channel_key", "parse_key_text"]

KEY_ENV = "LYNX_SIDE_CHANNEL_KEY"
KEY_FILE_ENV = "LYNX_SIDE_CHANNEL_KEY_FILE"
EXTRA_KEY_ENV = "LYNX_SIDE_CHANNEL_EXTRA_KEY"
EXTRA_KEY_FILE_ENV = "LYNX_SIDE_CHANNEL_EXTRA_KEY_FILE"
MIN_KEY_BYTES = 32
#: Fewer distinct byte values than this is a placeholder (zeros, spaces, one repeated character), not random bytes:
#: 32 random bytes take fewer than 8 values with a probability below 1e-35.
MIN_DISTINCT_BYTES = 8
_HOW = (f"set {KEY_FILE_ENV} to a file holding the deployment key (e.g. a mounted k8s Secret) or {KEY_ENV} to "
        f"the key as hex, >= {MIN_KEY_BYTES} random bytes (e.g. `openssl rand -hex 32`), the same on every prefill "
        "and decode instance; or, for local tests only, set insecure_side_channel: true in "
        "kv_connector_extra_config")


_HOW_EXTRA = (f"{EXTRA_KEY_FILE_ENV} / {EXTRA_KEY_ENV} name the other key of a key rotation (>= {MIN_KEY_BYTES} bytes, "
              "read like the deployment key); unset both outside a rotation (docs/OPERATIONS.md, \"Rotating the "
              "deployment key\")")


class SideChannelKeyError(ValueError):
    """The side-channel key is missing or unusable; the message says how to provide one."""


def _hex_key(text: str) -> bytes | None:
    """``text`` as a hex key, as both the file and the variable may hold it: whitespace anywhere (``xxd -p`` wraps
    its lines) and one leading ``0x`` are ignored; None when what is left is not all hex digits."""
    digits = "".join(text.split())
    if digits[:2].lower() == "0x":
        digits = digits[2:]
    if not digits or not all(c in string.hexdigits for c in digits):
        return None
    if len(digits) % 2:
        raise ValueError("odd")
    return bytes.fromhex(digits)


def parse_key_text(data: bytes, origin: str, how: str = _HOW) -> bytes:
    """A key file's content: hex text (read as ``LYNX_SIDE_CHANNEL_KEY`` is, see `_hex_key`) or raw bytes."""
    try:
        key = _hex_key(data.decode("ascii"))
    except UnicodeDecodeError:
        key = None
    except ValueError:
        raise SideChannelKeyError(f"{origin}: hex key has an odd number of digits; {how}") from None
    if key is None:
        key = bytes(data)
    return _checked(key, origin, how)


def _checked(key: bytes, origin: str, how: str) -> bytes:
    """``key`` when it is long enough and not a placeholder; else the error naming ``origin`` (never the key)."""
    if len(key) < MIN_KEY_BYTES:
        raise SideChannelKeyError(f"{origin}: key has {len(key)} bytes, at least {MIN_KEY_BYTES} are required; {how}")
    if len(set(key)) < MIN_DISTINCT_BYTES:
        raise SideChannelKeyError(f"{origin}: key's {len(key)} bytes take only {len(set(key))} distinct values: a "
                                  f"placeholder (zeros, blanks), not random bytes; {how}")
    return key


def load_side_channel_key(insecure: bool = False, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment key (bytes), or None in insecure mode (logged as a warning). Raises `SideChannelKeyError`."""
    env = os.environ if environ is None else environ
    if insecure:
        logger.warning("LynxConnector: insecure_side_channel is set: the side channel is NOT authenticated and "
                       "any process that reaches its port can read every request's staged KV. Local tests "
                       "only: never run like this on a shared network")
        return None
    key = _read_key(env, KEY_FILE_ENV, KEY_ENV, _HOW)
    if key is None:
        raise SideChannelKeyError(f"no side-channel key: neither {KEY_FILE_ENV} nor {KEY_ENV} is set; {_HOW}")
    return key


def load_extra_keys(insecure: bool = False, environ: Mapping[str, str] | None = None) -> tuple[bytes, ...]:
    """The key a rotation has this instance accept besides its own (``LYNX_SIDE_CHANNEL_EXTRA_KEY(_FILE)``, module
    docstring): ``()`` when neither is set, or in insecure mode. Raises `SideChannelKeyError` for an unusable one."""
    env = os.environ if environ is None else environ
    if insecure:
        return ()
    key = _read_key(env, EXTRA_KEY_FILE_ENV, EXTRA_KEY_ENV, _HOW_EXTRA)
    if key is None:
        return ()
    logger.info("LynxConnector: also accepting the side-channel key of %s (a key rotation: accepted from peers, "
                "never used to sign)", EXTRA_KEY_FILE_ENV if env.get(EXTRA_KEY_FILE_ENV, "").strip()
                else EXTRA_KEY_ENV)
    return (key,)


def _read_key(env: Mapping[str, str], file_var: str, hex_var: str, how: str) -> bytes | None:
    """The key of ``file_var`` (a file's path) or else ``hex_var`` (hex); None when neither is set."""
    path = env.get(file_var, "").strip()
    if path:
        try:
            with open(path, "rb") as fh:
                data = fh.read(1 << 16)
        except OSError as exc:
            raise SideChannelKeyError(f"{file_var}={path!r} cannot be read ({exc.strerror}); {how}") from None
        return parse_key_text(data, f"{file_var}={path!r}", how)
    text = env.get(hex_var, "").strip()
    if not text:
        return None
    try:
        key = _hex_key(text)
    except ValueError:
        key = None
    if key is None:
        raise SideChannelKeyError(f"{hex_var} is not valid hex; {how}")
    return _checked(key, hex_var, how)
