"""Per-layer, per-plane integrity of the staged planes (issue 14.4), in-band: no side-channel change.

Staging holds a request's planes layer after layer, each followed by an 8-byte trailer::

    anchor region   = [layer 0 anchor | cksum][layer 1 anchor | cksum] ...
    residual region = [layer 0 residual | cksum][layer 1 residual | cksum] ...   (absent when empty)

The trailer is the little-endian xxh3_64 of that layer's plane bytes, seeded with (P's transfer id and the
generation of its staging, layer index, plane; :func:`staging_id`): a flipped bit, a plane read from the wrong
offset or layer, or a region holding another request's bytes or another tenancy's (a lease reused under a pull)
all fail the check. P seals each layer right after encoding it; D verifies
every layer of a plane right after the READ lands and before anything of it is decoded into its blocks.

:func:`staged_layout` is the one place that knows these sizes and offsets: P's encode, D's pull and D's
decode all take them from it, so both sides agree byte for byte. xxh3_64 (the ``xxhash`` package) was the
fastest of crc32c / google-crc32c / xxhash measured on this project's CPU (about 2x a single-thread memcpy on
4-10 MiB buffers; ``lynx bench codec`` prints its row). Staging pools are host memory today; a device view is
copied to the host to be hashed (correct, not fast).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from .api import plane_nbytes
from .base import Codec
from .layout import KVLayout

#: Bytes of the checksum trailer after each layer's plane (a multiple of 8: layer offsets keep their alignment).
TRAILER_NBYTES = 8
PLANES = ("anchor", "residual")
#: Names this staged format in the P/D compat fields (a P and a D that stage differently fail the handshake).
INTEGRITY_FORMAT = f"xxh3_64/trailer{TRAILER_NBYTES}/v2"  # v2: seeded with the transfer id and generation


class IntegrityError(ValueError):
    """A staged plane of one layer does not match the checksum P wrote after it."""

    def __init__(self, message: str, layer: int, plane: str) -> None:
        super().__init__(message)
        self.layer, self.plane = layer, plane


def _host_bytes(view: torch.Tensor) -> memoryview:
    if view.device.type != "cpu":
        view = view.cpu()
    return memoryview(view.contiguous().numpy())


def staging_id(transfer_id: str, generation: int) -> str:
    """What the checksums of one staging are seeded with: P's transfer id and the staging's generation (its
    ``Regions.generation``), both known to P when it encodes and to D when the READ lands."""
    return f"{transfer_id}/{generation}"


def checksum_seed(staged_id: str, layer: int, plane: str) -> int:
    """The xxh3 seed of one layer's plane of one staging (``staged_id``: :func:`staging_id`)."""
    return xxhash.xxh3_64_intdigest(f"lynx/{staged_id}/{layer}/{plane}".encode())


def checksum(view: torch.Tensor, seed: int = 0) -> int:
    """xxh3_64 of the bytes of a contiguous uint8 view."""
    return xxhash.xxh3_64_intdigest(_host_bytes(view), seed)


@dataclass(frozen=True)
class PlaneLayout:
    """One plane of a request in staging: ``num_layers`` slots of ``plane_nbytes`` + trailer each."""

    name: str  # "anchor" or "residual"
    plane_nbytes: int  # one layer's plane, as the codec sizes it (no trailer)
    num_layers: int

    @property
    def stride(self) -> int:
        """Bytes of one layer's slot (plane + trailer; 0 for an empty plane, which has no trailer)."""
        return self.plane_nbytes + TRAILER_NBYTES if self.plane_nbytes else 0

    @property
    def nbytes(self) -> int:
        """Bytes of staging the whole plane needs (all layers, trailers included)."""
        return self.stride * self.num_layers

    def plane(self, buf: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer``'s plane bytes (what the codec reads and writes)."""
        o = layer * self.stride
        return buf[o:o + self.plane_nbytes]

    def trailer(self, buf: torch.Tensor, layer: int) -> torch.Tensor:
        o = layer * self.stride + self.plane_nbytes
        return buf[o:o + TRAILER_NBYTES]

    def seal(self, buf: torch.Tensor, layer: int, staged_id: str) -> None:
        """P: write layer ``layer``'s checksum into its trailer (right after encoding it)."""
        if not self.plane_nbytes:
            return
        digest = checksum(self.plane(buf, layer), checksum_seed(staged_id, layer, self.name))
        self.trailer(buf, layer).copy_(torch.frombuffer(bytearray(digest.to_bytes(8, "little")), dtype=torch.uint8))

    def verify(self, buf: torch.Tensor, layer: int, staged_id: str, layer_name: str = "") -> None:
        """D: raise :class:`IntegrityError` naming the layer and plane when the plane does not match."""
        if not self.plane_nbytes:
            return
        stored = int.from_bytes(bytes(_host_bytes(self.trailer(buf, layer))), "little")
        got = checksum(self.plane(buf, layer), checksum_seed(staged_id, layer, self.name))
        if got != stored:
            label = f"layer {layer}" + (f" ({layer_name})" if layer_name else "")
            raise IntegrityError(f"{label} {self.name} plane fails its checksum (stored {stored:#018x}, "
                                 f"computed {got:#018x}): corrupted in transit or not this request's bytes",
                                 layer, self.name)

    def verify_all(self, buf: torch.Tensor, staged_id: str, layer_names: list[str] | None = None) -> None:
        for i in range(self.num_layers):
            self.verify(buf, i, staged_id, layer_names[i] if layer_names else "")


@dataclass(frozen=True)
class StagedLayout:
    """A request's anchor and residual regions in staging (P's and D's, identical)."""

    anchor: PlaneLayout
    residual: PlaneLayout

    @property
    def nbytes(self) -> tuple[int, int]:
        """(anchor region, residual region) bytes, trailers included."""
        return self.anchor.nbytes, self.residual.nbytes

    def without_residual(self) -> StagedLayout:
        """What D stages when its mode never pulls the residual."""
        return StagedLayout(self.anchor, PlaneLayout("residual", 0, self.anchor.num_layers))


def staged_layout(codec: Codec, layout: KVLayout, num_tokens: int, num_layers: int, *,
                  staged_dtype: torch.dtype | None = None) -> StagedLayout:
    """The staging layout of a ``num_tokens``-token request of ``num_layers`` layers: the one source of the
    per-layer sizes, offsets and trailers on P and D. ``staged_dtype``: P's cache dtype (D passes what P
    announced; it sizes the passthrough's plane only); None = ``layout.dtype``."""
    a, r = plane_nbytes(codec, layout, num_tokens, staged_dtype=staged_dtype)
    return StagedLayout(PlaneLayout("anchor", a, num_layers), PlaneLayout("residual", r, num_layers))


__all__ = ["INTEGRITY_FORMAT", "IntegrityError", "PlaneLayout", "StagedLayout", "TRAILER_NBYTES", "checksum", "checksum_seed", "staging_id",
           "staged_layout"]
