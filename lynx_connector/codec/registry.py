"""``get_codec(name, **options)``: the Lynx codec and the baselines behind one interface.

Lynx default grouping (chosen by measured anchor vNMSE at <= 4.6 bits/value, see docs/ARCHITECTURE.md):
K per channel over 64 tokens (outlier channels get their own range, as in KIVI), V per token (its error
is averaged by attention weights along tokens).
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Codec
from .groupquant import GroupQuantCodec
from .simple import Fp8Codec, PassthroughCodec

LYNX_DEFAULTS = {"k_group": "channel", "v_group": "token", "group_tokens": 64}

_FACTORIES: dict[str, Callable[..., Codec]] = {
    "lynx": lambda **o: GroupQuantCodec("lynx", bits=4, residual=True, **{**LYNX_DEFAULTS, **o}),
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
