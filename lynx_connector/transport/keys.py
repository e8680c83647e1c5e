"""The deployment key of the side channel (docs/PROTOCOL.md section 1), read once at start-up.

``LYNX_SIDE_CHANNEL_KEY_FILE`` names a file holding the key (a k8s Secret mounted as a file: raw bytes, or hex
text: whitespace and a leading ``0x`` ignored), ``LYNX_SIDE_CHANNEL_KEY`` holds it as hex (read the same way); at
least 32 bytes. The file wins when both are set. Without a usable key start-up fails with `SideChannelKeyError`,
naming both variables; the only way to run without one is ``insecure_side_channel: true`` in
``kv_connector_extra_config`` (local tests), logged as a warning.
"""

from __future__ import annotations

import os
import string
from collections.abc import Mapping

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

__all__ = ["KEY_ENV", "KEY_FILE_ENV", "MIN_KEY_BYTES", "SideChannelKeyError", "load_side_channel_key",
           "parse_key_text"]

KEY_ENV = "LYNX_SIDE_CHANNEL_KEY"
KEY_FILE_ENV = "LYNX_SIDE_CHANNEL_KEY_FILE"
MIN_KEY_BYTES = 32
_HOW = (f"set {KEY_FILE_ENV} to a file holding the deployment key (e.g. a mounted k8s Secret) or {KEY_ENV} to "
        f"the key as hex, >= {MIN_KEY_BYTES} random bytes (e.g. `openssl rand -hex 32`), the same on every prefill "
        "and decode instance; or, for local tests only, set insecure_side_channel: true in "
        "kv_connector_extra_config")


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


def parse_key_text(data: bytes, origin: str) -> bytes:
    """A key file's content: hex text (read as ``LYNX_SIDE_CHANNEL_KEY`` is, see `_hex_key`) or raw bytes."""
    try:
        key = _hex_key(data.decode("ascii"))
    except UnicodeDecodeError:
        key = None
    except ValueError:
        raise SideChannelKeyError(f"{origin}: hex key has an odd number of digits; {_HOW}") from None
    if key is None:
        key = bytes(data)
    if len(key) < MIN_KEY_BYTES:
        raise SideChannelKeyError(f"{origin}: key has {len(key)} bytes, at least {MIN_KEY_BYTES} are required; {_HOW}")
    return key


def load_side_channel_key(insecure: bool = False, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment key (bytes), or None in insecure mode (logged as a warning). Raises `SideChannelKeyError`."""
    env = os.environ if environ is None else environ
    if insecure:
        logger.warning("LynxConnector: insecure_side_channel is set: the side channel is NOT authenticated and "
                       "any process that reaches its port can read every request's staged KV. Local tests "
                       "only: never run like this on a shared network")
        return None
    path = env.get(KEY_FILE_ENV, "").strip()
    if path:
        try:
            with open(path, "rb") as fh:
                data = fh.read(1 << 16)
        except OSError as exc:
            raise SideChannelKeyError(f"{KEY_FILE_ENV}={path!r} cannot be read ({exc.strerror}); {_HOW}") from None
        return parse_key_text(data, f"{KEY_FILE_ENV}={path!r}")
    text = env.get(KEY_ENV, "").strip()
    if not text:
        raise SideChannelKeyError(f"no side-channel key: neither {KEY_FILE_ENV} nor {KEY_ENV} is set; {_HOW}")
    try:
        key = _hex_key(text)
    except ValueError:
        key = None
    if key is None:
        raise SideChannelKeyError(f"{KEY_ENV} is not valid hex; {_HOW}")
    if len(key) < MIN_KEY_BYTES:
        raise SideChannelKeyError(f"{KEY_ENV} has {len(key)} bytes, at least {MIN_KEY_BYTES} are required; {_HOW}")
    return key
