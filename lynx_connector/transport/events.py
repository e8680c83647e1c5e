"""Completion events reported by `TransferSink.poll()`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ANCHOR", "RESIDUAL", "Stream", "TransferEvent"]

Stream = Literal["anchor", "residual"]
ANCHOR: Stream = "anchor"
RESIDUAL: Stream = "residual"


@dataclass(frozen=True)
class TransferEvent:
    """Terminal event of one stream of one pulled request (exactly one per pulled stream, unless aborted).

    `seconds` is measured from `pull()` to completion (or failure); `nbytes` is the bytes landed;
    `data_seconds` from the stream's first chunk post to completion (None if nothing was posted);
    `generation` that of P's staging the stream was read from (0 when it failed before P named its regions);
    `link_seconds` the link time its reads took (its share of D's busy link: `TransferScheduler._account`).
    """

    req_id: str
    stream: Stream
    ok: bool
    error: str | None
    nbytes: int
    seconds: float
    data_seconds: float | None = None
    generation: int = 0
    link_seconds: float = 0.0
