"""Codec API: the Lynx 4+4 anchor/residual codec and baselines over vLLM's paged KV (docs/ARCHITECTURE.md)."""

from lynx_connector.kernels.errors import KVRangeError, NonFiniteKVError

from .api import (
    STAGED_DTYPES,
    check_metadata,
    decode_anchor,
    decode_full,
    encode,
    kernel_path,
    merge_residual,
    plane_nbytes,
)
from .base import Codec
from .integrity import (
    INTEGRITY_FORMAT,
    TRAILER_NBYTES,
    IntegrityError,
    PlaneLayout,
    StagedLayout,
    checksum,
    staged_layout,
    staging_id,
)
from .layout import KVLayout, TileAddr, cpu_attn_isa
from .registry import CODEC_NAMES, LYNX_DEFAULTS, get_codec

__all__ = [
    "CODEC_NAMES",
    "Codec",
    "INTEGRITY_FORMAT",
    "IntegrityError",
    "KVLayout",
    "KVRangeError",
    "LYNX_DEFAULTS",
    "NonFiniteKVError",
    "PlaneLayout",
    "STAGED_DTYPES",
    "StagedLayout",
    "TRAILER_NBYTES",
    "TileAddr",
    "check_metadata",
    "checksum",
    "cpu_attn_isa",
    "decode_anchor",
    "decode_full",
    "encode",
    "get_codec",
    "kernel_path",
    "merge_residual",
    "plane_nbytes",
    "staged_layout",
    "staging_id",
]
