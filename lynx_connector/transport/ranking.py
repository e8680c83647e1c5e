"""Which queued stream D's transfer scheduler posts next: the ranking of chunks across requests.

Each pulled request says how its output depends on its planes (its ``order``, from the transfer mode's row in
``lynx_connector/modes.py``: :attr:`TransferMode.pull_order`):

* ``split`` (speculative): the anchor alone starts decoding; the residual comes later and unblocks the tokens
  held for verification.
* ``whole`` (full mode, the anchor-only mode and the single-stream baselines): nothing comes out until every
  plane it pulls has landed, so its planes are one unit, moved back to back.

Rule (``TransportConfig.order``), first match wins, remaining ties by queueing order:

0. **Age bound**: a stream queued for ``max_wait_s`` or longer goes before everything else, oldest first (the
   anchor of a request before its residual), so no stream waits unboundedly behind higher ranks.
1. the anchor of a ``split`` request (it starts decoding), in queueing order;
2. one tier of units that each unblock output when they land: the residual of a ``split`` request whose anchor
   is fully posted, and each ``whole`` request (its anchor, then its residual). A request's residual waits while
   its own anchor has readable bytes to post; with P publishing layer by layer (issue 15) it moves while the
   anchor waits for P (a ``split`` request's in slices of one pipeline poll of link time: scheduler.py).
   ``srpt`` (the default): the
   unit with the fewest bytes left to post first (equal ones: the one that became ready first, as in
   ``arrival``, then queueing order); ``arrival``: the unit that became ready first (a ``whole``
   request when it was queued, a ``split`` residual when its anchor was fully posted).

``anchor_first`` is the rule before issue 16, kept for comparison: every anchor of any request, in queueing
order, before any residual, no age bound. ``benchmarks/README.md`` ("Transfer order") has the simulated
comparison that chose ``srpt``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from lynx_connector.transport.events import ANCHOR, RESIDUAL

if TYPE_CHECKING:
    from lynx_connector.transport.scheduler import StreamJob

__all__ = ["ORDERS", "PULL_ORDERS", "SPLIT", "WHOLE", "PullOrder", "best", "rank"]

PullOrder = Literal["split", "whole"]
SPLIT: PullOrder = "split"
WHOLE: PullOrder = "whole"
PULL_ORDERS: tuple[str, ...] = (SPLIT, WHOLE)
#: The values of ``TransportConfig.order``.
ORDERS: tuple[str, ...] = ("srpt", "arrival", "anchor_first")

AGED, EARLY, UNIT, HELD = 0, 1, 2, 3


def _unit_left(job: StreamJob, sibling: StreamJob | None) -> int:
    left = job.nbytes - job.posted
    if job.order == WHOLE and sibling is not None:  # the anchor of a whole request counts its residual too
        left += sibling.nbytes - sibling.posted
    return left


def rank(job: StreamJob, sibling: StreamJob | None, now: float, order: str,
         max_wait_s: float) -> tuple | None:
    """The sort key of ``job`` (smaller goes first), or None when it may not be posted yet (a residual whose own
    anchor has readable bytes still to post). ``sibling``: the request's other queued stream, if any."""
    if job.stream == RESIDUAL and sibling is not None and sibling.postable > 0:
        return None  # a request's readable anchor bytes always go before its residual
    first = job.stream != ANCHOR
    if order == "anchor_first":
        return (EARLY if job.stream == ANCHOR else UNIT, job.seq)
    if now - job.t_queued >= max_wait_s:
        return (AGED, job.t_queued, first, job.seq)
    if job.order == SPLIT and job.stream == ANCHOR:
        return (EARLY, job.seq)
    ready = job.t_queued if job.order == WHOLE or job.t_ready is None else job.t_ready
    if order == "srpt":
        return (UNIT, _unit_left(job, sibling), ready, job.seq)
    return (UNIT, ready, job.seq)


def best(jobs: Iterable[StreamJob], siblings: dict[tuple[str, str], StreamJob], now: float, order: str,
         max_wait_s: float) -> tuple[StreamJob | None, tuple | None]:
    """The job to post next and its key (None, None when nothing may be posted)."""
    top: StreamJob | None = None
    top_key: tuple | None = None
    for job in jobs:
        if job.postable <= 0:  # all posted, or P has not published more of it yet (layer-wise)
            continue
        other = siblings.get((job.req_id, RESIDUAL if job.stream == ANCHOR else ANCHOR))
        key = rank(job, other, now, order, max_wait_s)
        if key is not None and (top_key is None or key < top_key):
            top, top_key = job, key
    return top, top_key
