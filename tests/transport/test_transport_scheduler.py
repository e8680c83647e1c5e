"""TransferScheduler with the fake NIXL: anchor-first ordering, window bound, pacing, error paths."""

from __future__ import annotations

import pytest
import torch

from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.events import TransferEvent
from lynx_connector.transport.scheduler import StreamJob, TransferScheduler

from .fakes import FakeFabric, FakeNixlWrapper

pytestmark = pytest.mark.timeout(30)

KB = 1024


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(fabric: FakeFabric, **cfg_kwargs):
    src, dst = FakeNixlWrapper(fabric, "P"), FakeNixlWrapper(fabric, "D")
    remote, local = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    src.register(remote)
    dst.register(local)
    dst.add_remote(b"P")
    events: list[TransferEvent] = []
    clock = Clock()
    cfg = TransportConfig(**{"chunk_bytes": 16 * KB, "window_bytes": 64 * KB, **cfg_kwargs})
    sched = TransferScheduler(dst, cfg, events.append, clock=clock, record_posts=True)

    def job(req: str, stream: str, off: int, n: int) -> StreamJob:
        return StreamJob(req, stream, "P", local.data_ptr() + off, remote.data_ptr() + off, n, clock())

    return sched, dst, job, events, clock, (remote, local)


def run_until_idle(sched: TransferScheduler, clock: Clock, limit: int = 10_000) -> None:
    for _ in range(limit):
        wait = sched.step()
        if wait is None and sched.idle:
            return
        clock.t += wait or 0.0
    raise AssertionError("scheduler did not go idle")


def test_anchor_first_across_requests_and_bytes(fabric: FakeFabric) -> None:
    sched, _, job, events, clock, (remote, local) = make(fabric)
    sched.submit(job("r1", "residual", 0, 100 * KB))
    sched.submit(job("r1", "anchor", 100 * KB, 40 * KB))
    sched.submit(job("r2", "residual", 140 * KB, 50 * KB))
    sched.submit(job("r2", "anchor", 190 * KB, 20 * KB))
    run_until_idle(sched, clock)
    streams = [s for _, s, _, _ in sched.stats.post_log]
    first_residual = streams.index("residual")
    assert all(s == "anchor" for s in streams[:first_residual])
    assert all(s == "residual" for s in streams[first_residual:])
    assert [r for r, s, _, _ in sched.stats.post_log if s == "anchor"][0] == "r1"  # FIFO within a queue
    assert all(n <= 16 * KB for *_, n in sched.stats.post_log)
    assert torch.equal(local[: 210 * KB], remote[: 210 * KB])
    assert [(e.req_id, e.stream, e.ok) for e in events][:2] == [("r1", "anchor", True), ("r2", "anchor", True)]
    assert {e.nbytes for e in events if e.req_id == "r1" and e.stream == "residual"} == {100 * KB}


def test_new_anchor_overtakes_residual_in_progress(fabric: FakeFabric) -> None:
    sched, _, job, events, clock, _ = make(fabric, link_gbps=8 * 16 * KB / 1e9 * 1000)  # 16 KiB per ms
    sched.submit(job("r1", "residual", 0, 256 * KB))
    for _ in range(5):
        clock.t += sched.step() or 0.0
    posted = len(sched.stats.post_log)
    assert 0 < posted < 16
    sched.submit(job("r2", "anchor", 300 * KB, 32 * KB))
    run_until_idle(sched, clock)
    log = sched.stats.post_log
    assert [r for r, *_ in log[posted : posted + 2]] == ["r2", "r2"]
    order = [(e.req_id, e.stream) for e in events]
    assert order == [("r2", "anchor"), ("r1", "residual")]


def test_window_bounds_bytes_in_flight(fabric: FakeFabric) -> None:
    sched, dst, job, events, clock, _ = make(fabric)
    dst.hang = True
    sched.submit(job("r1", "anchor", 0, 512 * KB))
    for _ in range(20):
        sched.step()
    assert sched.inflight_bytes == 64 * KB == sched.stats.max_inflight_bytes
    dst.hang = False
    run_until_idle(sched, clock)
    assert sched.stats.max_inflight_bytes <= 64 * KB
    assert [(e.ok, e.nbytes) for e in events] == [(True, 512 * KB)]
    assert dst.live_handles == 0


def test_pacing_time_matches_link_rate(fabric: FakeFabric) -> None:
    gbps = 8.0  # 1e9 bytes/s
    sched, _, job, events, clock, _ = make(fabric, link_gbps=gbps, chunk_bytes=16 * KB, window_bytes=64 * KB)
    sched.submit(job("r1", "anchor", 0, 1 << 20))
    run_until_idle(sched, clock)
    expected = ((1 << 20) - 16 * KB) / 1e9  # the bucket starts with one chunk
    assert events[0].ok and events[0].seconds == pytest.approx(expected, rel=1e-6)


def test_transfer_errors_fail_request(fabric: FakeFabric) -> None:
    sched, dst, job, events, clock, _ = make(fabric)
    dst.fail_peers.add("P")
    dst.delay_s = 10.0
    sched.submit(job("r1", "anchor", 0, 32 * KB))
    sched.submit(job("r1", "residual", 32 * KB, 32 * KB))
    run_until_idle(sched, clock)
    assert [(e.stream, e.ok) for e in events] == [("anchor", False), ("residual", False)]
    assert "returned ERR" in events[0].error
    assert dst.live_handles == 0


def test_post_exception_and_stall(fabric: FakeFabric) -> None:
    sched, dst, job, events, clock, _ = make(fabric, timeout_s=1.0)
    dst.fail_next = 1
    sched.submit(job("r1", "anchor", 0, 32 * KB))
    sched.step()
    assert events[-1].ok is False and "injected" in events[-1].error
    dst.hang = True
    sched.submit(job("r2", "anchor", 0, 32 * KB))
    sched.step()
    clock.t += 2.0
    sched.step()
    assert events[-1].req_id == "r2" and "stalled" in events[-1].error
    assert sched.idle and dst.live_handles == 0


def test_cancel_emits_nothing(fabric: FakeFabric) -> None:
    sched, dst, job, events, clock, _ = make(fabric)
    dst.hang = True
    sched.submit(job("r1", "anchor", 0, 128 * KB))
    sched.step()
    sched.cancel("r1")
    assert sched.idle and not events and dst.live_handles == 0


def test_residual_held_while_anchor_expected_and_idle_reset(fabric: FakeFabric) -> None:
    sched, _, job, events, clock, _ = make(fabric, link_gbps=8 * 16 * KB / 1e9 * 1000)
    sched.submit(job("r1", "residual", 0, 32 * KB))
    sched.hold_residual_until = 0.005
    assert sched.step() == pytest.approx(0.005) and not sched.stats.post_log
    clock.t = 0.005
    run_until_idle(sched, clock)
    assert events[-1].ok and events[-1].data_seconds is not None
    clock.t += 10.0  # a long idle gap must not bank 10 s of credit
    sched.submit(job("r2", "anchor", 0, 64 * KB))
    t0 = clock.t
    run_until_idle(sched, clock)
    assert clock.t - t0 == pytest.approx(3e-3)  # (64 - 16) KiB at 16 KiB/ms
