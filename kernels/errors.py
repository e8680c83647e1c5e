"""Errors raised while quantizing KV. They live here (not in ``codec``) because the torch twins detect them
from per-group statistics they compute anyway, which costs nothing compared with a separate ``isfinite`` pass."""

from __future__ import annotations


class NonFiniteKVError(ValueError):
    """KV contains NaN or +/-inf: quantizing it would silently put NaN into the receiver's cache."""


class KVRangeError(ValueError):
    """KV magnitude exceeds what the fp16 group metadata (min, scale) can represent (|x| > 65504)."""
