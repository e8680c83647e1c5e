"""``get_codec(name, **options)``: the Lynx codec and the baselines behind one interface.

Lynx default grouping (chosen by measured anchor vNMSE on real SmolLM2 KV at <= 4.6 bits/value, table in
docs/ARCHITECTURE.md): K per channel over 256 tokens (outlier channels get their own range, as in KIVI; 4.125
bits/value), V per channel over 32 tokens (5.0 bits/value); 4.5625 bits/value for the anchor plane overall.
Options override: ``group_tokens`` sets both K and V, ``k_group_tokens``/``v_group_tokens`` one each.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Codec
from .groupquant import GroupQuantCodec
from .simple import Fp8Codec, PassthroughCodec

LYNX_DEFAULTS = {"k_group": "channel", "v_group": "channel", "k_group_tokens": 256, "v_group_tokens": 32}



def _lynx(**options: object) -> Codec:
    defaults = dict(LYNX_DEFAULTS)
    if "group_tokens" in options:  # an explicit common group size replaces both per-tensor defaults
        defaults.pop("k_group_tokens")
        defaults.pop("v_group_tokens")
    return GroupQuantCodec("lynx", bits=4, residual=True, **{**defaults, **options})  # type: ignore[arg-type]


_FACTORIES: dict[str, Callable[..., Codec]] = {
    "lynx": _lynx,
    "int4": lambda **o: GroupQuantCodec("int4", bits=4, **{"k_group": "token", "v_group": "token", **o}),
    "int8": lambda **o: GroupQuantCodec("int8", bits=8, **{"k_group": "token", "v_group": "token", **o}),
    "int4_kivi": lambda **o: GroupQuantCodec(
        "int4_kivi", bits=4, **{"k_group": "channel", "v_group": "token", "group_tokens": 64, **o}
    ),
    "fp8": lambda **o: Fp8Codec(**o),
    "bf16": lambda **o: PassthroughCodec(**o),
}

CODEC_NAMES = tuple(_FACTORIES)


def get_codec(name: str, **options: object) -> Codec:
    """Build a codec by name; ``options`` override its grouping (e.g. ``k_group="token"``)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; expected one of {CODEC_NAMES}") from None
    return factory(**options)
