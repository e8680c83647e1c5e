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
    expected = (1 << 20) / 1e9  # every byte at the link rate: no credit
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


def test_residual_held_while_anchor_expected_and_no_idle_credit(fabric: FakeFabric) -> None:
    sched, _, job, events, clock, _ = make(fabric, link_gbps=8 * 16 * KB / 1e9 * 1000)
    sched.submit(job("r1", "residual", 0, 32 * KB))
    sched.hold_until = 0.005
    assert sched.step() == pytest.approx(0.005) and not sched.stats.post_log
    clock.t = 0.005
    run_until_idle(sched, clock)
    assert events[-1].ok and events[-1].data_seconds is not None
    clock.t += 10.0  # a long idle gap must not bank 10 s of credit
    sched.submit(job("r2", "anchor", 0, 64 * KB))
    t0 = clock.t
    run_until_idle(sched, clock)
    assert clock.t - t0 == pytest.approx(4e-3)  # 64 KiB at 16 KiB/ms


# ---- ranking across requests by what unblocks output (transport/ranking.py, issue 16.1) -----------------------
LINK_16K_PER_MS = 8 * 16 * KB / 1e9 * 1000  # Gbit/s that move one 16 KiB chunk per simulated millisecond


def split_and_whole():
    """Two speculative requests, then a smaller full-mode one: (name, stream, offset, bytes, order)."""
    return [("s1", "anchor", 0, 64 * KB, "split"), ("s1", "residual", 64 * KB, 96 * KB, "split"),
            ("s2", "anchor", 160 * KB, 64 * KB, "split"), ("s2", "residual", 224 * KB, 96 * KB, "split"),
            ("f", "anchor", 320 * KB, 32 * KB, "whole"), ("f", "residual", 352 * KB, 32 * KB, "whole")]


def landed(events, clock_at):
    return {(e.req_id, e.stream): clock_at[i] for i, e in enumerate(events)}


def run_recording(sched, clock, events):
    """run_until_idle, recording the simulated time at which each event arrived."""
    times: list[float] = []
    for _ in range(10_000):
        n = len(events)
        wait = sched.step()
        times.extend([clock.t] * (len(events) - n))
        if wait is None and sched.idle:
            return times
        clock.t += wait or 0.0
    raise AssertionError("scheduler did not go idle")


@pytest.mark.parametrize("order", ["srpt", "arrival"])
def test_full_request_behind_speculative_anchors_goes_before_their_residuals(fabric: FakeFabric, order) -> None:
    finish = {}
    for rule in (order, "anchor_first"):
        sched, _, job, events, clock, (remote, local) = make(fabric, link_gbps=LINK_16K_PER_MS, order=rule)
        for name, stream, off, n, kind in split_and_whole():
            j = job(name, stream, off, n)
            j.order = kind
            sched.submit(j)
        times = run_recording(sched, clock, events)
        at = landed(events, times)
        finish[rule] = max(at["f", "anchor"], at["f", "residual"])
        assert torch.equal(local[: 384 * KB], remote[: 384 * KB])
        posts = [(r, s) for r, s, *_ in sched.stats.post_log]
        if rule == order:
            # the speculative anchors first, then the full request whole (anchor, residual back to back), then
            # the speculative residuals
            firsts = list(dict.fromkeys(posts))
            assert firsts == [("s1", "anchor"), ("s2", "anchor"), ("f", "anchor"), ("f", "residual"),
                              ("s1", "residual"), ("s2", "residual")], firsts
            assert at["s2", "anchor"] < at["f", "residual"] < at["s1", "residual"]
    # paced: 8 ms of speculative anchors + 4 ms of f = 12 ms, against every anchor + every residual before f's
    assert finish[order] == pytest.approx(0.012)
    assert finish["anchor_first"] == pytest.approx(0.024)


def submit_whole(sched, job, requests) -> None:
    """Submit whole (single-unit) requests: (name, offset, anchor bytes, residual bytes), residual after anchor."""
    for name, off, anchor, residual in requests:
        for stream, o, n in (("anchor", off, anchor), ("residual", off + anchor, residual)):
            j = job(name, stream, o, n)
            j.order = "whole"
            sched.submit(j)


def test_whole_requests_move_back_to_back(fabric: FakeFabric) -> None:
    sched, _, job, events, clock, _ = make(fabric, link_gbps=LINK_16K_PER_MS, order="arrival")
    submit_whole(sched, job, [("w1", 0, 64 * KB, 64 * KB), ("w2", 128 * KB, 64 * KB, 64 * KB)])
    times = run_recording(sched, clock, events)
    assert [(e.req_id, e.stream) for e in events] == [("w1", "anchor"), ("w1", "residual"), ("w2", "anchor"),
                                                      ("w2", "residual")]
    at = landed(events, times)
    assert at["w1", "residual"] == pytest.approx(0.008)  # w1 done after its own 128 KiB, not after w2's anchor


def test_srpt_serves_the_smaller_whole_request_first_and_a_split_anchor_preempts(fabric: FakeFabric) -> None:
    sched, _, job, events, clock, _ = make(fabric, link_gbps=LINK_16K_PER_MS)
    big = job("big", "anchor", 0, 256 * KB)
    big.order = "whole"
    sched.submit(big)
    for _ in range(4):  # big starts moving
        clock.t += sched.step() or 0.0
    posted = len(sched.stats.post_log)
    assert posted > 0
    small = job("small", "anchor", 300 * KB, 32 * KB)
    small.order = "whole"
    sched.submit(small)
    spec = job("spec", "anchor", 400 * KB, 32 * KB)  # split by default
    sched.submit(spec)
    run_until_idle(sched, clock)
    after = [r for r, *_ in sched.stats.post_log[posted:]]
    assert after[:4] == ["spec", "spec", "small", "small"], after
    assert [e.req_id for e in events] == ["spec", "small", "big"]


def test_age_bound_serves_a_stream_starved_by_higher_ranks(fabric: FakeFabric) -> None:
    """A steady stream of speculative anchors would keep a full request waiting forever; after max_wait_s it goes
    first (oldest first) and its wait is bounded."""
    sched, _, job, events, clock, _ = make(fabric, link_gbps=LINK_16K_PER_MS, max_wait_s=0.01)
    full = job("full", "anchor", 0, 64 * KB)
    full.order = "whole"
    sched.submit(full)
    n = 0
    while clock.t < 0.05:
        if not any(r.startswith("spec") for r in sched.pending_requests()):
            sched.submit(job(f"spec{n}", "anchor", 512 * KB, 16 * KB))  # always one anchor waiting
            n += 1
        clock.t += sched.step() or 0.0
    run_until_idle(sched, clock)
    first_full = next(i for i, (r, *_) in enumerate(sched.stats.post_log) if r == "full")
    assert first_full > 5  # the anchors went first while the full request was young
    t_full = next(e for e in events if e.req_id == "full").seconds
    assert 0.01 <= t_full <= 0.01 + 4 * 0.001 + 0.002  # its 4 chunks right after the bound (+ one in flight)
    assert n > 20  # the anchors kept coming all along


def test_whole_streams_are_held_while_a_split_anchor_is_expected(fabric: FakeFabric) -> None:
    sched, _, job, events, clock, _ = make(fabric, link_gbps=LINK_16K_PER_MS)
    whole = job("w", "anchor", 0, 32 * KB)
    whole.order = "whole"
    sched.submit(whole)
    sched.hold_until = 0.004
    assert sched.step() == pytest.approx(0.004) and not sched.stats.post_log
    sched.submit(job("s", "anchor", 64 * KB, 16 * KB))  # a split anchor is never held
    sched.step()
    assert [r for r, *_ in sched.stats.post_log] == ["s"]
    clock.t = 0.004
    run_until_idle(sched, clock)
    assert [e.req_id for e in events] == ["s", "w"]


def test_pull_order_comes_from_the_modes_table() -> None:
    from lynx_connector.modes import MODES, get_mode

    assert get_mode("speculative").pull_order == "split"
    assert {m.name for m in MODES if m.pull_order == "split"} == {"speculative"}
    assert get_mode("full").pull_order == get_mode("bf16").pull_order == get_mode("anchor").pull_order == "whole"
    with pytest.raises(ValueError, match="order"):
        TransportConfig(order="lifo")


def _layer_wise(fabric: FakeFabric, req: str, order: str, **cfg):
    """A paced scheduler with one request of ``order`` whose planes (64 KiB each) P has published 16 KiB of; the
    last item holds the fake NIXL's memory (the caller keeps it alive while transfers run)."""
    sched, _, job, events, clock, mem = make(fabric, link_gbps=LINK_16K_PER_MS, **cfg)
    for j in (job(req, "anchor", 0, 64 * KB), job(req, "residual", 64 * KB, 64 * KB)):
        j.order, j.ready = order, 16 * KB
        sched.submit(j)
    return sched, events, clock, mem


def _steps(sched: TransferScheduler, clock: Clock, n: int = 10) -> None:
    for _ in range(n):
        clock.t += sched.step() or 0.001


def test_a_residual_moves_while_its_anchor_waits_for_p(fabric: FakeFabric) -> None:
    """Layer-wise publish (issue 15): a request's residual waits only while its own anchor has readable bytes."""
    sched, events, clock, _mem = _layer_wise(fabric, "w", "whole")
    _steps(sched, clock)
    assert [(s, off) for _, s, off, _ in sched.stats.post_log] == [("anchor", 0), ("residual", 0)]
    sched.extend("w", {"anchor": None, "residual": None})  # P published the rest
    run_until_idle(sched, clock)
    assert [s for _, s, *_ in sched.stats.post_log][2:5] == ["anchor"] * 3  # the anchor's rest before the residual's
    assert [(e.stream, e.ok) for e in events] == [("anchor", True), ("residual", True)]


def test_a_split_residual_fills_the_link_in_slices_while_its_anchor_waits_for_p(fabric: FakeFabric) -> None:
    """A speculative request's residual uses the link while its anchor waits for P, in slices of one pipeline poll
    of link time (here the 4 KiB floor), so the anchor's next layer waits behind at most one slice; once the whole
    anchor is posted the residual moves in whole chunks again."""
    sched, events, clock, _mem = _layer_wise(fabric, "s", "split", pipeline_poll_s=0.0001)
    _steps(sched, clock, 6)
    log = [(s, n) for _, s, _, n in sched.stats.post_log]
    assert log[0] == ("anchor", 16 * KB) and len(log) > 2
    assert all(s == "residual" and n == 4 * KB for s, n in log[1:])  # slices, not a 16 KiB chunk
    k = len(log)
    sched.extend("s", {"anchor": None, "residual": None})  # P published the rest
    sched.step()
    assert sched.stats.post_log[k][1] == "anchor"  # the anchor goes at once
    run_until_idle(sched, clock)
    log = [(s, n) for _, s, _, n in sched.stats.post_log]
    last_anchor = max(i for i, (s, _) in enumerate(log) if s == "anchor")
    assert all(s == "residual" for s, _ in log[last_anchor + 1:]) and log[-1][1] <= 16 * KB
    assert any(n == 16 * KB for s, n in log[last_anchor + 1:])  # whole chunks once the anchor is posted
    assert [(e.stream, e.ok) for e in events] == [("anchor", True), ("residual", True)]


def test_the_emulated_link_lends_no_credit_to_a_stream_or_its_anchor(fabric: FakeFabric) -> None:
    """The link emulation delivers no byte before its link time (issue 15's 10x regime: a token bucket's one chunk
    of credit let a single-stream request land a chunk early, and a speculative request's residual slices spend
    that credit instead of its anchor). A split request's anchor, published in two parts 10 ms apart while its
    residual fills the link in 4 KiB slices, lands no sooner than its remaining 48 KiB of link time after P
    published them (3 ms) and no later than one slice after that."""
    sched, events, clock, _mem = _layer_wise(fabric, "s", "split", pipeline_poll_s=0.0001)
    times = []
    while clock.t < 0.010:
        n = len(events)
        wait = sched.step()
        times.extend([clock.t] * (len(events) - n))
        clock.t += min(wait if wait is not None else 0.001, 0.010 - clock.t) or 0.0001
    assert not events  # the first 16 KiB of anchor took 1 ms; nothing else was readable
    t_pub = clock.t
    sched.extend("s", {"anchor": None, "residual": None})
    times += run_recording(sched, clock, events)
    at = landed(events, times)
    slice_s = 4 * KB / (16 * KB / 1e-3)
    assert t_pub + 3e-3 - 1e-9 <= at["s", "anchor"] <= t_pub + 3e-3 + slice_s + 1e-9
    assert at["s", "residual"] >= 128 * KB / (16 * KB / 1e-3) - 1e-9  # all 128 KiB at the link rate, at least


def test_anchor_event_first_when_both_streams_settle_in_one_pass(fabric: FakeFabric) -> None:
    """UCX does not order READ completions: when the residual's last chunk (posted first here) and the anchor's
    settle in the same pass, the anchor's event still comes first."""
    sched, dst, job, events, clock, _ = make(fabric)
    dst.hang = True
    sched.submit(job("r1", "residual", 0, 16 * KB))
    sched.step()
    sched.submit(job("r1", "anchor", 16 * KB, 16 * KB))
    sched.step()
    assert [s for _, s, _, _ in sched.stats.post_log] == ["residual", "anchor"]
    assert events == []
    dst.hang = False
    run_until_idle(sched, clock)
    assert [(e.stream, e.ok) for e in events] == [("anchor", True), ("residual", True)]


def test_link_time_is_shared_among_the_chunks_in_flight_and_leaves_idle_time_out(fabric: FakeFabric) -> None:
    """Each stream's ``link_seconds`` (told P in Done: its link meter) is its share of the time D had reads in
    flight: two requests read together split the busy time by bytes, so their sum is the busy time once; time with
    nothing in flight (D waiting for P) counts for no one."""
    sched, dst, job, events, clock, _ = make(fabric, chunk_bytes=16 * KB, window_bytes=64 * KB)
    dst.hang = True  # four chunks in flight: 16 KB of r1, 48 KB of r2 (the window)
    sched.submit(job("r1", "anchor", 0, 16 * KB))
    sched.submit(job("r2", "anchor", 64 * KB, 48 * KB))
    sched.step()
    assert sched.inflight_bytes == 64 * KB
    clock.t += 2.0
    dst.hang = False
    run_until_idle(sched, clock)
    by_req = {e.req_id: e.link_seconds for e in events}
    assert by_req == {"r1": pytest.approx(0.5), "r2": pytest.approx(1.5)}
    clock.t += 30.0  # idle: D waits for P's next layer
    sched.submit(job("r1", "residual", 128 * KB, 16 * KB))
    dst.hang = True
    sched.step()
    clock.t += 0.25
    dst.hang = False
    run_until_idle(sched, clock)
    assert events[-1].stream == "residual" and events[-1].link_seconds == pytest.approx(0.25)


def test_paced_link_time_is_the_bytes_at_the_link_rate(fabric: FakeFabric) -> None:
    gbps = 8.0  # 1e9 bytes/s
    sched, _, job, events, clock, _ = make(fabric, link_gbps=gbps)
    sched.submit(job("r1", "anchor", 0, 256 * KB))
    sched.submit(job("r1", "residual", 256 * KB, 128 * KB))
    sched.submit(job("r2", "anchor", 512 * KB, 128 * KB))
    run_until_idle(sched, clock)
    assert len(events) == 3
    for e in events:
        assert e.link_seconds == pytest.approx(e.nbytes / 1e9, rel=1e-3)


def test_paced_link_time_counts_a_late_wake_up_that_the_link_caught_up() -> None:
    """A posting thread that wakes up late for the emulated link (a loaded box) posts a chunk the link started
    when it freed (``catch_up_s``): the chunk's link time counts from then, so the meter still reads the bytes at
    the link's rate, not less by the lateness (CI read 0.029 s for 0.033 s of bytes)."""
    late = 0.002
    gbps = 8 * 16 * KB / 1e9 * 1000  # 16 KiB per ms
    sched, _, job, events, clock, _ = make(FakeFabric(), link_gbps=gbps, catch_up_s=0.005)
    sched.submit(job("r1", "anchor", 0, 8 * 16 * KB))
    for _ in range(1000):
        wait = sched.step()
        if wait is None and sched.idle:
            break
        clock.t += (wait or 0.0) + (late if wait else 0.0)  # every wake-up 2 ms late
    (ev,) = events
    assert ev.ok and ev.link_seconds == pytest.approx(8 * 0.001, rel=0.05), ev.link_seconds


# ---- behaviours a mutation review found unchecked ----------------------------------------------------------------
def test_srpt_counts_a_whole_requests_residual_in_its_unit_size(fabric: FakeFabric) -> None:
    """Under ``srpt`` a whole request is one unit: its size is its anchor plus its residual. w1 (16 KiB anchor +
    96 KiB residual = 112 KiB) queued before w2 (32 + 32 = 64 KiB): w2 moves first, whole, then w1, with no
    interleaving (counting the anchor alone would start w1's small anchor first and split the two requests)."""
    sched, _, job, events, clock, _ = make(fabric, link_gbps=LINK_16K_PER_MS, order="srpt")
    submit_whole(sched, job, [("w1", 0, 16 * KB, 96 * KB), ("w2", 256 * KB, 32 * KB, 32 * KB)])
    run_until_idle(sched, clock)
    posts = [(r, s) for r, s, *_ in sched.stats.post_log]
    assert list(dict.fromkeys(posts)) == [("w2", "anchor"), ("w2", "residual"), ("w1", "anchor"),
                                          ("w1", "residual")], posts
    reqs = [r for r, _ in posts]
    assert reqs == ["w2"] * reqs.count("w2") + ["w1"] * reqs.count("w1")  # back to back, no interleaving
    assert [(e.req_id, e.stream) for e in events] == [("w2", "anchor"), ("w2", "residual"), ("w1", "anchor"),
                                                      ("w1", "residual")]


def test_a_stale_smaller_extend_does_not_lower_ready(fabric: FakeFabric) -> None:
    """extend() messages may arrive out of order: a smaller readable size after a larger one must not take back
    bytes P already published (ready stays at the maximum, and posting goes on up to it)."""
    sched, _, job, events, clock, _ = make(fabric)
    j = job("r1", "anchor", 0, 128 * KB)
    j.ready = 16 * KB
    sched.submit(j)
    sched.extend("r1", {"anchor": 64 * KB})
    sched.extend("r1", {"anchor": 32 * KB})  # stale
    assert j.ready == 64 * KB
    for _ in range(20):
        clock.t += sched.step() or 0.001
    assert j.posted == j.done == 64 * KB
    assert sum(n for *_, n in sched.stats.post_log) == 64 * KB and not events
    assert sched.left("r1", "anchor") is None  # P still publishes it


def test_cancel_tears_only_requests_with_chunks_nixl_has_not_finished(fabric: FakeFabric) -> None:
    """On a paced link a chunk NIXL finished (DONE) may still be on the emulated link; cancelling its request then
    leaves no RMA that could land later, so it is not torn (its staging need not be quarantined). A chunk NIXL
    has not finished (PROC) does tear the request."""
    sched, dst, job, events, clock, _ = make(fabric, link_gbps=LINK_16K_PER_MS)
    sched.submit(job("r1", "anchor", 0, 16 * KB))
    sched.step()
    (f,) = sched._inflight
    assert f.state == "DONE" and f.t_due > clock.t  # moved, but the emulated link still carries it
    sched.cancel("r1")
    assert sched.take_torn("r1") is False
    assert sched.idle and not events and dst.live_handles == 0

    sched2, dst2, job2, events2, clock2, _ = make(fabric, link_gbps=LINK_16K_PER_MS)
    dst2.hang = True
    sched2.submit(job2("r2", "anchor", 0, 16 * KB))
    sched2.step()
    assert sched2._inflight[0].state is None
    sched2.cancel("r2")
    assert sched2.take_torn("r2") is True and sched2.take_torn("r2") is False  # reported once
    assert sched2.idle and not events2 and dst2.live_handles == 0


def test_left_counts_in_flight_bytes_as_not_landed(fabric: FakeFabric) -> None:
    """left() is the bytes not landed yet: a chunk posted but still in flight (PROC) has not landed."""
    sched, dst, job, events, clock, _ = make(fabric)
    dst.hang = True
    sched.submit(job("r1", "residual", 0, 16 * KB))
    assert sched.left("r1", "residual") == 16 * KB
    sched.step()
    assert sched.inflight_bytes == 16 * KB and sched.stats.chunks_posted == 1
    assert sched.left("r1", "residual") == 16 * KB
    dst.hang = False
    clock.t += sched.step() or 0.0
    assert [(e.stream, e.ok) for e in events] == [("residual", True)]
    assert sched.left("r1", "residual") is None  # finished: no longer queued


def test_srpt_equal_bytes_left_the_unit_ready_first_goes_first(fabric: FakeFabric) -> None:
    """Two units with equal bytes left: the one that became ready first goes first, before queueing order. A split
    request's residual (queued first) becomes ready only when its anchor is fully posted (1 ms); a whole request
    queued after it, at 0, was ready then, so it goes before the residual."""
    sched, _, job, events, clock, _ = make(fabric, link_gbps=LINK_16K_PER_MS, order="srpt")
    sched.submit(job("s", "anchor", 0, 32 * KB))  # split: two chunks, fully posted at 1 ms
    sched.submit(job("s", "residual", 32 * KB, 32 * KB))
    w = job("w", "anchor", 128 * KB, 32 * KB)
    w.order = "whole"
    sched.submit(w)
    run_until_idle(sched, clock)
    firsts = list(dict.fromkeys((r, s) for r, s, *_ in sched.stats.post_log))
    assert firsts == [("s", "anchor"), ("w", "anchor"), ("s", "residual")], firsts
    assert [(e.req_id, e.stream) for e in events] == [("s", "anchor"), ("w", "anchor"), ("s", "residual")]


def test_anchor_first_a_later_requests_anchor_overtakes_an_earlier_residual(fabric: FakeFabric) -> None:
    """``anchor_first``: every anchor, of any request, before any residual (the rule before issue 16): w2's anchor,
    queued after w1's residual, goes before it, although both requests are whole."""
    sched, _, job, events, clock, _ = make(fabric, link_gbps=LINK_16K_PER_MS, order="anchor_first")
    submit_whole(sched, job, [("w1", 0, 32 * KB, 32 * KB), ("w2", 128 * KB, 32 * KB, 32 * KB)])
    run_until_idle(sched, clock)
    firsts = list(dict.fromkeys((r, s) for r, s, *_ in sched.stats.post_log))
    assert firsts == [("w1", "anchor"), ("w2", "anchor"), ("w1", "residual"), ("w2", "residual")], firsts
