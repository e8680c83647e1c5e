"""Staging pool: one big uint8 CPU tensor registered with NIXL once, carved by a first-fit allocator.

Each request gets one contiguous anchor region and (for two-stream codecs) one contiguous residual region,
so a request costs one descriptor per stream whatever its number of blocks and layers. A full pool raises
`StagingFullError`; nothing is ever overwritten. Thread-safe.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

__all__ = ["StagingFullError", "StagedRequest", "StagingPool"]

ALIGN = 256


class StagingFullError(RuntimeError):
    """The staging pool has no free contiguous region large enough."""


@dataclass(frozen=True)
class StagedRequest:
    """A request's staging: `anchor` and `residual` (None if single-stream) are uint8 views in the pool."""

    req_id: str
    anchor: torch.Tensor
    residual: torch.Tensor | None
    anchor_offset: int
    residual_offset: int

    @property
    def anchor_nbytes(self) -> int:
        return int(self.anchor.numel())

    @property
    def residual_nbytes(self) -> int:
        return 0 if self.residual is None else int(self.residual.numel())


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StagingPool:
    """A contiguous uint8 buffer with a first-fit, coalescing allocator and a per-request table."""

    def __init__(self, nbytes: int, device: str = "cpu") -> None:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"pool size must be a positive int, got {nbytes!r}")
        # zeros, not empty: pages are faulted in now, not by the first transfer into them
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, size)
        self._used: dict[int, int] = {}  # offset -> size
        self._requests: dict[str, StagedRequest] = {}

    @property
    def base_addr(self) -> int:
        return int(self.buffer.data_ptr())

    # ---- raw regions -------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Reserve `nbytes` (> 0) and return the region's offset; raises `StagingFullError` when full."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"allocation size must be a positive int, got {nbytes!r}")
        size = _round_up(nbytes)
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free - size)
                    self._used[off] = size
                    return off
        raise StagingFullError(
            f"staging pool full: need {nbytes} bytes, {self.free_bytes} free of {self.nbytes} "
            f"(largest free region {self.largest_free})"
        )

    def free(self, offset: int) -> None:
        """Return a region; neighbours coalesce."""
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                raise KeyError(f"offset {offset} is not an allocated region")
            i = bisect.bisect_left(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]

    def offset_of(self, view: torch.Tensor) -> int:
        """Offset of a uint8 view that lies inside the pool (ValueError otherwise)."""
        if view.dtype != torch.uint8 or not view.is_contiguous():
            raise ValueError("staging views must be contiguous uint8 tensors")
        off = int(view.data_ptr()) - self.base_addr
        if off < 0 or off + view.numel() > self.nbytes or view.device != self.buffer.device:
            raise ValueError("view does not lie inside this staging pool")
        return off

    # ---- requests ----------------------------------------------------------------------------
    def alloc_request(self, req_id: str, anchor_nbytes: int, residual_nbytes: int) -> StagedRequest:
        """One anchor and one residual region (residual skipped when 0) for `req_id`."""
        if not isinstance(residual_nbytes, int) or residual_nbytes < 0:
            raise ValueError(f"residual_nbytes must be an int >= 0, got {residual_nbytes!r}")
        with self._lock:
            if req_id in self._requests:
                raise ValueError(f"request {req_id!r} already has staging")
        a_off = self.alloc(anchor_nbytes)
        r_off = -1
        if residual_nbytes:
            try:
                r_off = self.alloc(residual_nbytes)
            except StagingFullError:
                self.free(a_off)
                raise
        staged = StagedRequest(
            req_id,
            self.view(a_off, anchor_nbytes),
            self.view(r_off, residual_nbytes) if residual_nbytes else None,
            a_off,
            r_off,
        )
        with self._lock:
            self._requests[req_id] = staged
        return staged

    def get_request(self, req_id: str) -> StagedRequest | None:
        with self._lock:
            return self._requests.get(req_id)

    def free_request(self, req_id: str) -> bool:
        """Free a request's regions; False if it had none."""
        with self._lock:
            staged = self._requests.pop(req_id, None)
        if staged is None:
            return False
        self.free(staged.anchor_offset)
        if staged.residual is not None:
            self.free(staged.residual_offset)
        return True

    # ---- counters ----------------------------------------------------------------------------
    @property
    def bytes_allocated(self) -> int:
        with self._lock:
            return sum(self._used.values())

    @property
    def regions_live(self) -> int:
        with self._lock:
            return len(self._used)

    @property
    def requests_live(self) -> int:
        with self._lock:
            return len(self._requests)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(s for _, s in self._free)

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max((s for _, s in self._free), default=0)
