"""D's receive half (lynx_connector/receiving.py) driven with a scripted sink: the order in which one poll's events
are applied. Real transfers are in tests/connector/test_worker_fake_nixl.py and tests/integration."""

from __future__ import annotations

import types

from lynx_connector.metadata import RecvSpec
from lynx_connector.receiving import ReceiveHalf, _Recv
from lynx_connector.stats import LynxStats
from lynx_connector.testing import FaultHooks
from lynx_connector.transport.events import TransferEvent


class _ScriptedSink:
    """Hands out one batch of events per poll and records what the receive half asks of it."""

    def __init__(self, batches: list[list[TransferEvent]]) -> None:
        self.batches, self.calls = batches, []

    def poll(self) -> list[TransferEvent]:
        return self.batches.pop(0) if self.batches else []

    def staged(self) -> list:
        return []

    def first_tokens(self) -> list:
        return []

    def left(self, req_id: str, stream: str) -> None:
        return None

    def abort(self, req_id: str) -> None:
        self.calls.append(("abort", req_id))

    def release(self, req_id: str) -> None:
        self.calls.append(("release", req_id))

    def free_staging(self, req_id: str) -> None:
        self.calls.append(("free_staging", req_id))


def test_a_failed_anchor_write_ends_the_request_before_its_residual_is_merged() -> None:
    """A speculative pull whose residual event came in an earlier poll and whose anchor write then fails (a
    decode error after the checksums passed): the request fails once. Before, the poll fell through to the merge
    and wrote the full planes from D's freed staging, freed it a second time and reported the request failed,
    finished and merged at once (review)."""
    half = ReceiveHalf.__new__(ReceiveHalf)
    half.config = types.SimpleNamespace(residual_grace_s=0.05, timeout_s=5.0)
    half.sink = _ScriptedSink([[TransferEvent("r1", "residual", True, None, 10, 0.1)],
                               [TransferEvent("r1", "anchor", True, None, 10, 0.2)]])
    half.stats, half._faults, half._step = LynxStats(), FaultHooks(), 1
    half._init_receive()
    writes: list[tuple[str, bool]] = []

    def write_blocks(rec: _Recv, full: bool) -> None:
        writes.append(("full" if full else "anchor", rec.spec.req_id in half._recvs))
        if not full:
            raise ValueError("decode failed")

    half._write_blocks = write_blocks
    half._verify = lambda rec, stream, generation: None
    spec = RecvSpec("r1", [1], 16, 0, "127.0.0.1", (1,), "x", "e", "speculative")
    half._recvs["r1"] = _Recv(spec=spec, staged=object(), t_start=0.0)
    half._poll_recvs()
    half._poll_recvs()
    assert writes == [("anchor", True)]
    assert half.sink.calls.count(("free_staging", "r1")) == 1, half.sink.calls
    done, failed = half.take_results()
    meta = half.take_worker_meta()
    assert failed == {"r1"} and done == {"r1"}  # reported once, as a failed load (vLLM's policy applies)
    assert meta is None or "r1" not in meta.residual_merged
