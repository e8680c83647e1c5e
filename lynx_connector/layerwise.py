"""P: a request's staging while it is being encoded, layer by layer (pipelined transfer, issue 15).

`StagingJob` is one request being encoded into its staging: begun (staging allocated, checksum seed fixed), then
each layer encoded and sealed, then published. The worker runs every layer at once after the forward (the
whole-request path) or, with ``layerwise`` on, one layer per ``save_kv_layer`` call inside the forward of the
step in which the prompt completes: vLLM calls it right after each attention layer has written its KV, so
layer ``i``'s planes are encoded while layers ``i+1..`` compute, and `TransferSource.publish_partial` makes the
finished layers readable at once. D reads them while P is still computing.

Chunked prefill: a prompt split over several steps is encoded only in the step of its last chunk (its earlier
chunks' KV is then already in the cache), layer by layer in that step. The Lynx groups span up to 256 tokens
(K per channel), so a group is final only once all of its tokens exist; encoding earlier chunks separately
would need groups aligned to chunk boundaries, and the last chunk's layers still gate the transfer's end. What
this buys: the transfer overlaps the last chunk's forward (all of a prompt that fits in one step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lynx_connector.codec import StagedLayout

__all__ = ["StagingJob"]


@dataclass
class StagingJob:
    """One request being encoded into its staging (P's worker; built by ``LynxConnectorWorker._begin``)."""

    req_id: str
    spec: Any  # metadata.SaveSpec
    codec: Any
    layout: StagedLayout
    staged: Any  # transport.pool.StagedRequest
    staging_id: str  # seeds the checksums (transfer id and generation)
    encoded: set[int] = field(default_factory=set)  # layer indices encoded and sealed
    #: Seconds of encoding and sealing, summed over the layers: what P's codec costs the request (layer-wise,
    #: inside the forward), without the forward's own time between its layers.
    encode_s: float = 0.0
    published: bool = False  # whole (TransferSource.publish called)

    @property
    def has_residual(self) -> bool:
        return self.layout.nbytes[1] > 0

    def ready_bytes(self) -> tuple[int, int]:
        """Readable (anchor, residual) prefix bytes: whole layers from the first, in order."""
        n = 0
        while n in self.encoded:
            n += 1
        return n * self.layout.anchor.stride, (n * self.layout.residual.stride if self.has_residual else 0)

    def anchor_plane(self, layer: int) -> torch.Tensor:
        return self.layout.anchor.plane(self.staged.anchor, layer)

    def residual_plane(self, layer: int) -> torch.Tensor | None:
        return self.layout.residual.plane(self.staged.residual, layer) if self.has_residual else None

    def seal(self, layer: int) -> None:
        self.layout.anchor.seal(self.staged.anchor, layer, self.staging_id)
        if self.has_residual:
            self.layout.residual.seal(self.staged.residual, layer, self.staging_id)
        self.encoded.add(layer)
