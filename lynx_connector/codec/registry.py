"""``get_codec(name, **options)``: the Lynx codec and the baselines behind one interface.

Lynx default grouping (issue 17, chosen by what speculation needs: attention-output error under the model's real
queries, greedy agreement and dNLL on real text, at <= 4.6 bits/value; table in benchmarks/README.md and
benchmarks/results/anchor_search.md): K per channel over 64 tokens (outlier channels get their own range, as in
KIVI), V per token (each token's value its own range: the attention-sink token, whose value is near zero and
which draws a large share of the attention, keeps its precision); 4.5 bits/value for the anchor plane at
head_dim 64. The previous default, K per channel over 256 and V per channel over 32 (lower V vNMSE, but 7x the
attention-output error from V on SmolLM2), stays selectable: ``k_group_tokens=256, v_group="channel"``.
Options override: ``group_tokens`` sets both K and V, ``k_group_tokens``/``v_group_tokens`` one each
(``v_group_tokens`` sizes V's channel groups when ``v_group="channel"``).
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Codec
from .groupquant import GroupQuantCodec
from .simple import Fp8Codec, PassthroughCodec

LYNX_DEFAULTS = {"k_group": "channel", "v_group": "token", "k_group_tokens": 64, "v_group_tokens": 32}
#: The options the Lynx codec takes (``codec_options``).
LYNX_OPTIONS = (*LYNX_DEFAULTS, "group_tokens")



def _lynx(**options: object) -> Codec:
    unknown = sorted(set(options) - set(LYNX_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; the Lynx codec takes {', '.join(LYNX_OPTIONS)}")
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
