"""Codec API: the Lynx 4+4 anchor/residual codec and baselines over vLLM's paged KV (docs/ARCHITECTURE.md)."""

from lynx_connector.kernels.errors import KVRangeError, NonFiniteKVError

from .api import decode_anchor, decode_full, encode, merge_residual, plane_nbytes
from .base import Codec
from .layout import KVLayout, TileAddr, cpu_attn_isa
from .registry import CODEC_NAMES, LYNX_DEFAULTS, get_codec

__all__ = [
    "CODEC_NAMES",
    "Codec",
    "KVLayout",
    "KVRangeError",
    "LYNX_DEFAULTS",
    "NonFiniteKVError",
    "TileAddr",
    "cpu_attn_isa",
    "decode_anchor",
    "decode_full",
    "encode",
    "get_codec",
    "merge_residual",
    "plane_nbytes",
]
