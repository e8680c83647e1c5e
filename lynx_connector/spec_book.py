"""D's scheduler half, speculative mode: the requests decoding on their anchor until their residual is merged.

A speculative request is *pending* from its allocation until every worker has merged its residual (tensor
parallel: each rank merges its own shard, in its own step; vLLM's aggregator hands the scheduler the first
worker's meta and aggregates the others into it, so merges are counted over steps as vLLM counts
``finished_recving``), or until one worker's residual failed (then the other workers' pulls are cancelled before
the failure policy frees or reuses the blocks). The speculative scheduler (``LynxSpecScheduler``, through
``SpeculationPort``) takes the merged and failed requests each step; the workers hear which requests are
settled, so they forget that their pull ended (lynx_connector/receiving.py).
"""

from __future__ import annotations

from lynx_connector.metadata import LynxWorkerMeta

__all__ = ["SpecBook"]


class SpecBook:
    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self.pending: set[str] = set()
        self.merged: set[str] = set()  # since the speculative scheduler last took them
        self.failed: set[str] = set()  # residual failed after the anchor was reported
        #: The token P sampled after the prompt, for pending requests (taken by LynxSpecScheduler).
        self.first_token: dict[str, int] = {}
        self.settled: list[str] = []  # for the workers, in the next step's metadata
        self._counts: dict[str, int] = {}  # workers that merged, for requests not merged by all yet

    def start(self, req_id: str, first_token: int | None) -> None:
        self.pending.add(req_id)
        if first_token is not None:
            self.first_token[req_id] = first_token

    def whole(self, req_id: str) -> None:
        """Its KV is whole when reported ready (auto: P named a passthrough mode): nothing to wait for."""
        self.pending.discard(req_id)
        self.first_token.pop(req_id, None)

    def observe(self, meta: LynxWorkerMeta) -> set[str]:
        """One step's (aggregated) worker meta; returns the requests whose residual failed now, whose other
        workers' pulls must be cancelled."""
        for req_id, tok in meta.first_tokens.items():  # concurrent flow: P's token, later than the params
            if req_id in self.pending:
                self.first_token.setdefault(req_id, tok)
        merged = set()
        for req_id, n in meta.merge_counts().items():
            if req_id in self.pending:
                total = self._counts.pop(req_id, 0) + n
                if total >= self.workers:
                    merged.add(req_id)
                else:
                    self._counts[req_id] = total
        failed = meta.residual_failed & self.pending
        for req_id in failed:
            self._counts.pop(req_id, None)
        self.merged |= merged
        self.failed |= failed
        self.pending -= merged | failed
        self.settled.extend(merged | failed)
        return failed

    def take_merged(self) -> set[str]:
        out, self.merged = self.merged, set()
        return out

    def take_failed(self) -> set[str]:
        out, self.failed = self.failed, set()
        return out

    def take_settled(self) -> list[str]:
        out, self.settled = self.settled, []
        return out

    def forget(self, req_id: str) -> bool:
        """The request ends or is preempted: True when its residual was still pending."""
        self.merged.discard(req_id)
        self.failed.discard(req_id)
        self._counts.pop(req_id, None)
        was = req_id in self.pending
        self.pending.discard(req_id)
        return was
