"""Staging pool: one big uint8 CPU tensor registered with NIXL once, carved by a first-fit allocator.

Each request gets one contiguous anchor region and (for two-stream codecs) one contiguous residual region,
so a request costs one descriptor per stream whatever its number of blocks and layers. A full pool raises
`StagingFullError`; nothing is ever overwritten. Thread-safe.

Every request's staging gets a new generation number (the pool's allocation counter): it names this tenancy of
the regions (P sends it in ``Regions``; the checksums are seeded with it). A request freed with a quarantine
(``free_request(req_id, quarantine_s=...)``: P's lease ran out, so a D may still be reading) keeps its regions
out of the free list until the quarantine is over.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from dataclasses import dataclass

import torch

__all__ = ["StagingFullError", "StagedRequest", "StagingPool"]

ALIGN = 256


class StagingFullError(RuntimeError):
    """The staging pool has no free contiguous region large enough."""


class StagingAbandoned(RuntimeError):
    """D gave up on an expected request (its Done) while P allocated its staging: nothing is staged."""


@dataclass(frozen=True)
class StagedRequest:
    """A request's staging: `anchor` and `residual` (None if single-stream) are uint8 views in the pool."""

    req_id: str
    anchor: torch.Tensor
    residual: torch.Tensor | None
    anchor_offset: int
    residual_offset: int
    generation: int = 0  # this tenancy of the regions (unique per pool)

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
        self._requests: dict[str, StagedRequest | None] = {}  # None: its regions are being allocated
        self._generations = itertools.count(1)
        self._quarantine: list[tuple[float, int]] = []  # (release at, offset): freed, not reusable yet

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
            self._release_quarantine(time.monotonic())
            for i, (off, free) in enumerate(self._free):
                if free < size and free >= nbytes and off + free == self.nbytes:
                    size = free  # the pool's last bytes: a size that is no multiple of ALIGN still fits there
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

    def free(self, offset: int, quarantine_s: float = 0.0) -> None:
        """Return a region (after ``quarantine_s`` seconds when > 0); neighbours coalesce."""
        with self._lock:
            if offset not in self._used or any(o == offset for _, o in self._quarantine):
                raise KeyError(f"offset {offset} is not an allocated region")
            if quarantine_s > 0:
                self._quarantine.append((time.monotonic() + quarantine_s, offset))
                return
            self._free_locked(offset)

    def _release_quarantine(self, now: float) -> None:
        """Regions whose quarantine is over go back to the free list (lock held)."""
        if not self._quarantine:
            return
        keep = []
        for release_at, offset in self._quarantine:
            if release_at <= now:
                self._free_locked(offset)
            else:
                keep.append((release_at, offset))
        self._quarantine = keep

    def _free_locked(self, offset: int) -> None:
        """Put a used region back on the free list, coalescing with its neighbours (lock held)."""
        size = self._used.pop(offset)
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
    def fits(self, anchor_nbytes: int, residual_nbytes: int) -> bool:
        """Whether the empty pool could hold a request's two regions (as ``alloc_request`` places them: the anchor
        rounded up to ``ALIGN``): False means it can never be staged here, however long it waits."""
        if not residual_nbytes:
            return anchor_nbytes <= self.nbytes
        return _round_up(anchor_nbytes) + residual_nbytes <= self.nbytes

    def alloc_request(self, req_id: str, anchor_nbytes: int, residual_nbytes: int) -> StagedRequest:
        """One anchor and one residual region (residual skipped when 0) for `req_id`."""
        if not isinstance(residual_nbytes, int) or residual_nbytes < 0:
            raise ValueError(f"residual_nbytes must be an int >= 0, got {residual_nbytes!r}")
        with self._lock:
            if req_id in self._requests:
                raise ValueError(f"request {req_id!r} already has staging")
            self._requests[req_id] = None  # the id is taken now (None: being allocated): a second caller fails above
        try:
            return self._alloc_regions(req_id, anchor_nbytes, residual_nbytes)
        except BaseException:
            with self._lock:
                del self._requests[req_id]
            raise

    def _alloc_regions(self, req_id: str, anchor_nbytes: int, residual_nbytes: int) -> StagedRequest:
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
            next(self._generations),
        )
        with self._lock:
            self._requests[req_id] = staged
        return staged

    def get_request(self, req_id: str) -> StagedRequest | None:
        with self._lock:
            return self._requests.get(req_id)

    def free_request(self, req_id: str, quarantine_s: float = 0.0) -> bool:
        """Free a request's regions (reusable only after ``quarantine_s`` when > 0); False if it had none."""
        with self._lock:
            staged = self._requests.get(req_id)
            if staged is None:  # none, or being allocated (its own caller frees it on failure)
                return False
            del self._requests[req_id]
        self.free(staged.anchor_offset, quarantine_s)
        if staged.residual is not None:
            self.free(staged.residual_offset, quarantine_s)
        return True

    # ---- counters ----------------------------------------------------------------------------
    @property
    def bytes_allocated(self) -> int:
        """Bytes in regions not free (live or quarantined)."""
        with self._lock:
            self._release_quarantine(time.monotonic())
            return sum(self._used.values())

    @property
    def regions_live(self) -> int:
        with self._lock:
            self._release_quarantine(time.monotonic())
            return len(self._used)

    @property
    def requests_live(self) -> int:
        with self._lock:
            return len(self._requests)

    @property
    def quarantined_bytes(self) -> int:
        """Bytes freed with a quarantine that is not over yet (counted in `bytes_allocated` too)."""
        with self._lock:
            self._release_quarantine(time.monotonic())
            return sum(self._used[o] for _, o in self._quarantine)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._release_quarantine(time.monotonic())
            return sum(s for _, s in self._free)

    @property
    def largest_free(self) -> int:
        with self._lock:
            self._release_quarantine(time.monotonic())
            return max((s for _, s in self._free), default=0)
