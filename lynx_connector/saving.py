"""P side: stage each request whose prompt completed, waiting (bounded) for room when the staging pool is full.

The scheduler half keeps a saved request's KV blocks after it finishes (``request_finished`` -> True) until
this queue reports it in ``finished_sending``: the request has been encoded and published, given up, or
aborted, *and* vLLM has told the worker that it finished (``finished_req_ids``; blocks of a request that is
still running must never be freed). A request that finds the pool full waits, in arrival order, with its KV
blocks held on P (so P's KV cache, not a silent timeout, pushes back on new prefills); D's queries meanwhile
get NotReady. If no room appears within ``wait_s`` P rejects it: D's next query gets ``staging_full`` with the
pool's size, and ``kv_load_failure_policy`` applies on D at once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from lynx_connector.logger import init_logger
from lynx_connector.metadata import SaveSpec
from lynx_connector.transport import StagingFullError, TransferSource

logger = init_logger(__name__)

__all__ = ["SaveQueue"]


class SaveQueue:
    """``stage(spec)`` allocates, encodes and publishes one request (raises `StagingFullError` when the pool has
    no room; any other failure it handles itself, aborting the staging); ``on_reject(kind)`` counts failures."""

    def __init__(self, source: TransferSource, stage: Callable[[SaveSpec], None], wait_s: float,
                 on_reject: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._stage = stage
        self._wait_s = wait_s
        self._on_reject = on_reject
        self._clock = clock
        self._waiting: OrderedDict[str, tuple[SaveSpec, float]] = OrderedDict()  # arrival order
        self._resolved: set[str] = set()  # staged, rejected or aborted
        self._finished: set[str] = set()  # vLLM says finished, not yet reported

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, spec: SaveSpec) -> None:
        try:
            self._source.expect(spec.req_id, spec.transfer_id or None, spec.token or None)
        except ValueError as exc:  # its ticket is another request's (params replayed): that request only fails
            logger.error("LynxConnector: request %s not staged: %s", spec.req_id, exc)
            self._on_reject("stage")
            self._resolved.add(spec.req_id)
            return
        if self._waiting or not self._try(spec):  # behind others already waiting: keep the order
            self._waiting[spec.req_id] = (spec, self._clock() + self._wait_s)
            logger.info("LynxConnector: staging full, request %s (%d tokens) waits for room (%d waiting)",
                        spec.req_id, spec.num_tokens, len(self._waiting))

    def resolved(self, req_id: str) -> None:
        """A request staged (or given up) outside the queue: in the forward, layer by layer (worker.save_layer)."""
        self._resolved.add(req_id)

    def reject_waiting(self, req_id: str, code: str, message: str) -> bool:
        """Give up a request still waiting for room, as a wait that timed out is (D hears ``code``); False when it
        is not waiting (staged already, or never queued)."""
        if self._waiting.pop(req_id, None) is None:
            return False
        self._reject(req_id, code, message)
        return True

    def abort(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
        self._source.abort(req_id)
        self._resolved.add(req_id)

    def _try(self, spec: SaveSpec) -> bool:
        if self._source.take_abandoned(spec.req_id):  # D gave up while it waited for room: nothing to stage
            logger.info("LynxConnector: request %s not staged: its decode instance gave up on it while it waited "
                        "for room", spec.req_id)
            self._resolved.add(spec.req_id)
            return True
        try:
            self._stage(spec)
        except StagingFullError:
            return False
        self._resolved.add(spec.req_id)
        return True

    def retry(self) -> None:
        """Stage waiting requests while they fit (oldest first); reject those that waited ``wait_s``."""
        now = self._clock()
        while self._waiting:
            req_id, (spec, deadline) = next(iter(self._waiting.items()))
            if self._try(spec):
                del self._waiting[req_id]
                continue
            if now < deadline:
                break
            del self._waiting[req_id]
            stats = self._source.stats()
            self._reject(req_id, "staging_full",
                         f"P's staging pool (staging_mb={self._source.pool.nbytes >> 20}) had no room for request "
                         f"{req_id} ({spec.num_tokens} tokens) within {self._wait_s:.1f}s "
                         f"({stats['requests_live']} requests staged): raise staging_mb or limit the requests in "
                         f"flight (lynx proxy --max-inflight)")

    def _reject(self, req_id: str, code: str, message: str) -> None:
        """A request taken out of the queue unstaged: logged, D told why, counted, its blocks released."""
        logger.error("LynxConnector: %s", message)
        self._source.reject(req_id, code, message)
        self._on_reject("stage")
        self._resolved.add(req_id)

    def finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """The requests whose blocks P may free now: resolved here and finished in vLLM."""
        self._finished.update(r for r in finished_req_ids if r in self._resolved or r in self._waiting)
        done = self._finished & self._resolved
        self._finished -= done
        self._resolved -= done
        return done
