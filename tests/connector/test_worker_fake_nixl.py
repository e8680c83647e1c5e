"""The connector's worker half (``LynxConnectorWorker``) on P and D in one process: real codec on real CPU-layout
KV caches, real transport (zmq side channel), the fake NIXL of tests/transport/fakes.py. P encodes and publishes,
D pulls and writes its blocks; every failure releases staging on both sides. The real engines run in
tests/integration."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from lynx_connector import worker as worker_mod
from lynx_connector.codec import (
    PlaneLayout,
    StagedLayout,
    decode_anchor,
    encode,
    get_codec,
    merge_residual,
    staged_layout,
)
from lynx_connector.config import LynxConfig
from lynx_connector.layerwise import StagingJob
from lynx_connector.metadata import LynxConnectorMetadata, RecvSpec, SaveSpec, mint_ticket
from lynx_connector.modes import get_mode
from lynx_connector.transport import StagingAbandoned, TransferSink, TransferSource
from tests.transport.fakes import FakeFabric, FakeNixlWrapper

pytestmark = pytest.mark.timeout(60)

BS, H, D, NB, LAYERS = 16, 2, 32, 8, 2
N = 40  # prompt tokens: blocks 0..2, the last one partial
P_BLOCKS, D_BLOCKS = [0, 1, 2], [5, 3, 6]


def vcfg(role: str) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role=role),
                           cache_config=SimpleNamespace(block_size=BS), model_config=SimpleNamespace(model="tiny"))


def use_fake_nixl(monkeypatch) -> FakeFabric:
    """The workers' transport endpoints are the real ones, over one fake NIXL fabric."""
    fabric = FakeFabric()
    monkeypatch.setattr(worker_mod, "TransferSource", lambda cfg, compat, name=None, **kw: TransferSource(
        cfg, compat, nixl=FakeNixlWrapper(fabric, name), name=name, **kw))
    monkeypatch.setattr(worker_mod, "TransferSink", lambda cfg, compat, name=None, **kw: TransferSink(
        cfg, compat, nixl=FakeNixlWrapper(fabric, name), name=name, **kw))
    return fabric


@pytest.fixture
def pair(monkeypatch):
    fabric = use_fake_nixl(monkeypatch)
    made = []

    def make(role: str, **extra):
        cfg = LynxConfig.from_extra_config({"staging_mb": 4, "timeout_s": 2, **extra})
        w = worker_mod.LynxConnectorWorker(vcfg(role), "e-" + role, cfg)
        gen = torch.Generator().manual_seed(len(made))
        caches = {f"layer.{i}": (torch.randn(NB, H, BS, 2 * D, generator=gen) if role == "kv_producer"
                                 else torch.zeros(NB, H, BS, 2 * D)) for i in range(LAYERS)}
        w.register_kv_caches(caches)
        made.append(w)
        return w, caches

    yield make, fabric
    for w in made:
        w.shutdown()


def publish(p, mode: str, req: str = "p1") -> None:
    p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id=req, block_ids=P_BLOCKS, num_tokens=N, mode=mode)]))


def recv_spec(p, mode: str, req: str = "d1", remote: str = "p1") -> RecvSpec:
    """What D's scheduler half builds from P's kv_transfer_params: P's transfer id and token of ``remote``
    (fresh random ones for a request P does not know)."""
    host, port = p.source.address
    try:
        tid, token = p.source.ticket(remote)
    except KeyError:
        tid, token = mint_ticket()
    return RecvSpec(req_id=req, block_ids=D_BLOCKS, num_tokens=N, skip_blocks=0, remote_host=host,
                    remote_ports=(port,), remote_req_id=remote, remote_engine_id="e-kv_producer", mode=mode,
                    transfer_id=tid, token=token)


def poll_until(workers, pred: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not met in time"
        for w in workers:
            w.poll()
        time.sleep(0.002)


def expected(p_caches, mode: str, full: bool) -> dict[str, torch.Tensor]:
    """What D's blocks must hold: the codec applied to P's KV, written into zeroed blocks ``D_BLOCKS``."""
    from lynx_connector.codec import KVLayout

    layout = KVLayout.from_kv_cache(next(iter(p_caches.values())), block_size=BS, backend="cpu")
    codec = get_codec(get_mode(mode).codec)
    sl = staged_layout(codec, layout, N, len(p_caches))  # the staging layout P and D use (checksum trailers)
    a, r = sl.nbytes
    anchor, residual = torch.zeros(a, dtype=torch.uint8), torch.zeros(r, dtype=torch.uint8)
    out = {}
    for i, (name, kv) in enumerate(p_caches.items()):
        pa, pr = sl.anchor.plane(anchor, i), sl.residual.plane(residual, i) if r else None
        encode(codec, kv, P_BLOCKS, layout, N, pa, pr)
        ref = torch.zeros_like(kv)
        if full:
            merge_residual(codec, pa, pr, ref, D_BLOCKS, layout, N)
        else:
            decode_anchor(codec, pa, ref, D_BLOCKS, layout, N)
        out[name] = ref
    return out


def assert_staging_freed(p, d) -> None:
    poll_until([p, d], lambda: p.source.stats()["regions_live"] == 0)
    assert d.sink.pool.regions_live == 0 and d._recvs == {}


@pytest.mark.parametrize("mode", ["full", "anchor", "int8"])
def test_pull_writes_the_blocks_the_mode_needs(pair, mode):
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer")
    publish(p, mode)
    assert p.stats.data  # encoded and published
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, mode)]))
    done: set[str] = set()
    poll_until([p, d], lambda: done.update(d.take_results()[0]) or "d1" in done)
    want = expected(p_caches, mode, full=mode == "full")
    for name in d_caches:
        assert torch.equal(d_caches[name], want[name]), name  # untouched outside rows [0, N) of D_BLOCKS
    assert d.take_worker_meta() is None
    assert_staging_freed(p, d)


def test_speculative_reports_the_anchor_then_merges_the_residual(pair):
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer")
    publish(p, "speculative")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")],
                                       test_hooks={"d1": {"delay_residual_steps": 3}}))
    done: set[str] = set()
    poll_until([p, d], lambda: done.update(d.take_results()[0]) or "d1" in done)
    anchor = expected(p_caches, "speculative", full=False)
    assert all(torch.equal(d_caches[n], anchor[n]) for n in d_caches)  # ready on its anchor
    assert d.take_worker_meta() is None
    merged: set[str] = set()
    poll_until([p, d], lambda: merged.update(getattr(d.take_worker_meta(), "residual_merged", ())) or "d1" in merged)
    full = expected(p_caches, "speculative", full=True)
    assert all(torch.equal(d_caches[n], full[n]) for n in d_caches)
    assert d.take_results() == (set(), set())  # reported once
    assert_staging_freed(p, d)


def paced_events(d, batch: int) -> None:
    """D's sink hands its worker its transfer events ``batch`` at a time (1: the anchor in one step, the residual in
    a later one; 2: both in the same step): deterministic steps whatever the timing of the fake transfers."""
    real, queue = d.sink.poll, []

    def poll():
        queue.extend(real())
        if len(queue) < batch:
            return []
        out = queue[:batch]
        del queue[:batch]
        return out

    d.sink.poll = poll


def test_residual_failure_after_the_anchor_is_reported_in_worker_meta(pair):
    make, _ = pair
    # no grace: D starts on the anchor whenever the residual is still in flight when the anchor's event is
    # handled (with the default grace it may hold the anchor for a residual due soon: a plain load failure then,
    # test_residual_failure_in_the_anchors_step_is_a_plain_load_failure)
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer", residual_grace_s=0)
    paced_events(d, 1)
    publish(p, "speculative")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")],
                                       test_hooks={"d1": {"fail_residual": True}}))
    poll_until([p, d], lambda: d._recvs["d1"].anchor_landed)
    assert d.take_results() == ({"d1"}, set())  # running on its anchor
    poll_until([p, d], lambda: "d1" not in d._recvs)
    assert d.take_results() == (set(), set())
    assert d.take_worker_meta().residual_failed == {"d1"}  # the speculative scheduler applies the policy
    assert_staging_freed(p, d)


def record_writes(d) -> list[bool]:
    """The ``full`` flag of every write of a pull into D's blocks, in order."""
    calls: list[bool] = []
    real = d._write_blocks

    def write(rec, full):
        calls.append(full)
        real(rec, full)

    d._write_blocks = write
    return calls


@pytest.mark.parametrize("grace", [0.05, 0.0])
def test_a_residual_landing_with_its_anchor_is_not_preceded_by_an_anchor_step(pair, grace):
    """``residual_grace_s``: when a speculative request's residual lands with its anchor, D writes it at full
    precision once and reports it ready and merged in one step (no step on the anchor, whose merge and verification
    would follow at once); with 0 it starts on the anchor and merges in the same step, as before."""
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer", residual_grace_s=grace)
    writes = record_writes(d)
    publish(p, "speculative")
    paced_events(d, 2)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")]))
    poll_until([p, d], lambda: "d1" not in d._recvs)
    assert writes == ([True] if grace else [False, True])
    assert d.take_results() == ({"d1"}, set())
    assert d.take_worker_meta().residual_merged == {"d1"}  # ready and merged in the same step
    full = expected(p_caches, "speculative", full=True)
    assert all(torch.equal(d_caches[n], full[n]) for n in d_caches)
    assert_staging_freed(p, d)


@pytest.mark.parametrize("delay", [0, 2])
def test_a_delayed_merge_hook_opts_out_of_the_grace_even_at_zero_steps(pair, delay):
    """``delay_residual_steps`` (0 included) stands for a residual that lands after the anchor: D starts on the
    anchor and merges ``delay`` steps later. Before, a 0 let the grace hold the anchor back while the hook waited
    for the anchor's step: the request never finished (the CI hang of tests/integration/test_speculative.py)."""
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer", residual_grace_s=0.05)
    writes = record_writes(d)
    publish(p, "speculative")
    paced_events(d, 2)  # the residual lands in the anchor's poll: the grace would apply without the hook
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")],
                                       test_hooks={"d1": {"delay_residual_steps": delay}}))
    poll_until([p, d], lambda: "d1" not in d._recvs)
    assert writes == [False, True]
    full = expected(p_caches, "speculative", full=True)
    assert all(torch.equal(d_caches[n], full[n]) for n in d_caches)
    assert_staging_freed(p, d)


def test_an_anchor_waits_no_longer_than_its_grace_for_a_due_residual(pair):
    """A residual that is due (few bytes left) but does not land within ``residual_grace_s``: D starts on the
    anchor when the grace ends, and merges the residual when it lands."""
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer", residual_grace_s=0.2)
    writes = record_writes(d)
    real_poll, held = d.sink.poll, []
    release = [False]

    def poll():  # the anchor's event as it comes; the residual's only once the test releases it
        out = []
        for ev in real_poll() + held:
            (out if ev.stream == "anchor" or release[0] else held).append(ev)
        held[:] = [e for e in held if e not in out]
        return out

    d.sink.poll = poll
    d.sink.left = lambda req_id, stream: 1  # one byte left: due at any rate
    publish(p, "speculative")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")]))
    poll_until([p, d], lambda: d._recvs["d1"].anchor_landed)
    t_anchor = time.monotonic()
    assert writes == [] and d._recvs["d1"].grace_until is not None  # waiting for the residual
    poll_until([p, d], lambda: writes == [False])
    assert time.monotonic() - t_anchor >= 0.15  # not before the grace ended
    assert d.take_results() == ({"d1"}, set())  # running on its anchor
    anchor = expected(p_caches, "speculative", full=False)
    assert all(torch.equal(d_caches[n], anchor[n]) for n in d_caches)
    release[0] = True
    poll_until([p, d], lambda: "d1" not in d._recvs)
    assert writes == [False, True] and d.take_worker_meta().residual_merged == {"d1"}
    assert_staging_freed(p, d)


def test_residual_failure_in_the_anchors_step_is_a_plain_load_failure(pair):
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    publish(p, "speculative")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")],
                                       test_hooks={"d1": {"fail_residual": True}}))
    paced_events(d, 2)
    poll_until([p, d], lambda: "d1" not in d._recvs)
    assert d.take_results() == ({"d1"}, {"d1"})  # vLLM's kv_load_failure_policy applies
    assert d.take_worker_meta() is None
    assert_staging_freed(p, d)


def test_failed_read_fails_the_pull_and_releases_staging(pair):
    make, fabric = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    publish(p, "full")
    fabric.agents["lynx-e-kv_consumer-tp0-dst"].fail_peers.add("lynx-e-kv_producer-tp0-src")  # every READ fails
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full")]))
    failed: set[str] = set()
    done: set[str] = set()

    def step() -> bool:
        a, b = d.take_results()
        done.update(a)
        failed.update(b)
        return "d1" in done

    poll_until([p, d], step)
    assert failed == {"d1"}  # kv_load_failure_policy applies
    assert_staging_freed(p, d)


def test_unknown_remote_request_fails_the_pull(pair):
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    publish(p, "full")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full", remote="nope")]))
    failed: set[str] = set()
    poll_until([p, d], lambda: failed.update(d.take_results()[1]) or "d1" in failed)
    assert d.sink.pool.regions_live == 0 and d._recvs == {}


@pytest.mark.parametrize("outcome", ["aborted", "cancelled"])
def test_abort_and_cancel_release_staging(pair, outcome):
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    publish(p, "speculative")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")],
                                       test_hooks={"d1": {"delay_residual_steps": 1000}}))
    done: set[str] = set()
    poll_until([p, d], lambda: done.update(d.take_results()[0]) or "d1" in done)  # running on its anchor
    if outcome == "aborted":
        d.start_load(LynxConnectorMetadata(recv_aborted=["d1"]))
        assert d.take_results() == ({"d1"}, set())  # reported again: vLLM frees the blocks now
    else:
        d.start_load(LynxConnectorMetadata(recv_cancelled=["d1"]))
        assert d.take_results() == (set(), set())  # preempted: its blocks are gone, nothing to report
    assert d.take_worker_meta() is None
    assert_staging_freed(p, d)


@pytest.mark.parametrize("end", ["residual_merged", "residual_failed"])
def test_a_request_finished_in_the_step_its_residual_ended_still_frees_its_blocks(pair, end):
    """vLLM calls request_finished before it hands the scheduler half the step's worker meta: a speculative request
    that stops (P's first token, max_tokens) in the step its residual merged or failed is still pending there, so
    it keeps its blocks and asks the worker (recv_aborted) for a finished_recving. The worker's pull is over by
    then: it must still report the request, or vLLM holds its blocks and the request for good."""
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer", residual_grace_s=0)
    paced_events(d, 1)
    publish(p, "speculative")
    hooks = {"fail_residual": True} if end == "residual_failed" else {"delay_residual_steps": 2}
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")], test_hooks={"d1": hooks}))
    done: set[str] = set()
    poll_until([p, d], lambda: done.update(d.take_results()[0]) or "d1" in done)  # running on its anchor
    ended: set[str] = set()
    poll_until([p, d], lambda: ended.update(getattr(d.take_worker_meta(), end, ())) or "d1" in ended)
    assert d.take_results() == (set(), set())
    d.start_load(LynxConnectorMetadata(recv_aborted=["d1"]))  # the scheduler half's request_finished
    assert d.take_results() == ({"d1"}, set())  # vLLM frees the blocks now
    d.start_load(LynxConnectorMetadata(recv_aborted=["d1"]))
    assert d.take_results() == (set(), set())  # once
    assert_staging_freed(p, d)

def test_corrupt_residual_fault_injection_changes_the_merge(pair):
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer", fault_injection="corrupt_residual")
    publish(p, "full")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full")]))
    done: set[str] = set()
    poll_until([p, d], lambda: done.update(d.take_results()[0]) or "d1" in done)
    sound = expected(p_caches, "full", full=True)
    assert any(not torch.equal(d_caches[n], sound[n]) for n in d_caches)
    assert_staging_freed(p, d)


def test_full_staging_on_p_and_d_waits_for_room_then_serves(pair):
    """Issue 13: a request that finds P's or D's staging pool full waits (P keeps the KV blocks, D's queries get
    NotReady) and is served once room appears; P reports it finished_sending only then."""
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer")
    p_fill = p.source.alloc("filler", p.source.pool.nbytes - 4096, 0)  # P's pool is nearly full
    d_fill = d.sink.pool.alloc_request("filler", d.sink.pool.nbytes - 4096, 0)  # and D's
    publish(p, "full")
    assert p.saves.waiting == 1 and p.finished_sending({"p1"}) == set()  # blocks stay held while it waits
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full")]))
    assert len(d._recv_waiting) == 1 and d._recvs == {}
    for _ in range(20):
        d.poll()
        time.sleep(0.01)
    assert d.take_results() == (set(), set())  # nothing failed while waiting
    del p_fill, d_fill
    p.source.abort("filler")
    d.sink.pool.free_request("filler")
    p.poll()
    assert p.finished_sending(set()) == {"p1"}  # staged now, and vLLM said it finished above
    done: set[str] = set()
    poll_until([p, d], lambda: done.update(d.take_results()[0]) or "d1" in done)
    want = expected(p_caches, "full", full=True)
    assert all(torch.equal(d_caches[n], want[n]) for n in d_caches)
    assert_staging_freed(p, d)


def test_a_request_d_gives_up_on_while_p_allocates_is_not_staged(pair, monkeypatch):
    """D's Done for a waiting request lands while P allocates its staging (TransferSource.alloc raises
    StagingAbandoned, tested with real zmq in tests/transport): P stages nothing, the save queue counts it
    resolved, vLLM's blocks are released and no other request fails."""
    make, _ = pair
    p, _ = make("kv_producer")
    p.source.alloc("filler", p.source.pool.nbytes - 4096, 0)
    publish(p, "full")
    assert p.saves.waiting == 1

    def gave_up(req_id, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise StagingAbandoned(f"request {req_id!r}: its decode instance gave up on it")

    p.source.abort("filler")
    monkeypatch.setattr(p.source, "alloc", gave_up)
    p.poll()
    assert p.saves.waiting == 0 and p.finished_sending({"p1"}) == {"p1"}
    assert p.source.pool.regions_live == 0 and p.stats.data["failed_stage"] == 0


def test_a_request_preempted_on_p_while_its_save_waits_is_not_sent(pair):
    """A P request that goes on decoding (max_tokens > 1) and is preempted while its save waits for staging room
    lost its blocks (another request may write them): P gives the save up and D's pull fails with P's reason,
    instead of P staging whatever the blocks hold later. One already staged is not touched."""
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    publish(p, "full", req="p0")  # staged at once
    p.source.alloc("filler", p.source.pool.free_bytes - 4096, 0)
    publish(p, "full")
    assert p.saves.waiting == 1
    to_d = recv_spec(p, "full")  # P's params for p1 (its ticket, expected while it waits)
    p.save(LynxConnectorMetadata(save_preempted=["p1", "p0"]))
    assert p.saves.waiting == 0 and p.finished_sending({"p1"}) == {"p1"} and p.stats.data["failed_stage"] == 1
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[to_d]))
    errors = load_errors(d)
    failed: set[str] = set()
    poll_until([p, d], lambda: failed.update(d.take_results()[1]) or "d1" in failed)
    assert "preempted" in errors["d1"], errors
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full", req="d0", remote="p0")]))
    done: set[str] = set()
    poll_until([p, d], lambda: done.update(d.take_results()[0]) or "d0" in done)
    assert errors.get("d0") is None


def test_staging_that_never_frees_fails_with_a_clear_error(pair):
    """P gives up after timeout_s / 2 (D hears staging_full at once); D gives up after timeout_s."""
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    p.source.alloc("filler", p.source.pool.nbytes - 4096, 0)
    publish(p, "full")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full")]))
    failed: set[str] = set()
    t0 = time.monotonic()
    poll_until([p, d], lambda: failed.update(d.take_results()[1]) or "d1" in failed)
    assert 0.9 <= time.monotonic() - t0 < 1.9  # P's wait (timeout_s / 2 = 1 s), not D's deadline (2 s)
    assert p.finished_sending({"p1"}) == {"p1"} and p.stats.data["failed_stage"] == 1
    assert d.sink.pool.regions_live == 0 and d._recvs == {}
    d.sink.pool.alloc_request("filler", d.sink.pool.nbytes - 4096, 0)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full", req="d2", remote="p2")]))
    failed.clear()
    t0 = time.monotonic()
    poll_until([p, d], lambda: failed.update(d.take_results()[1]) or "d2" in failed)
    assert 1.9 <= time.monotonic() - t0 < 3.0 and d._recv_waiting == {}  # D's own bound: timeout_s = 2 s


# ---- integrity (issue 14.4): checksums per layer per plane in staging, metadata finite -------------------------

def load_errors(d) -> dict[str, str]:
    """Record the error every pull of D ends with (req_id -> error; None on success)."""
    errors: dict[str, str] = {}
    real = d._finish_recv

    def finish(rec, error, outcome="failed"):
        errors[rec.spec.req_id] = error
        real(rec, error, outcome)

    d._finish_recv = finish
    return errors


def results_until(workers, d, pred) -> tuple[set[str], set[str]]:
    done: set[str] = set()
    failed: set[str] = set()

    def step() -> bool:
        a, b = d.take_results()
        done.update(a)
        failed.update(b)
        return pred(done, failed)

    poll_until(workers, step)
    return done, failed


def test_the_modes_pull_order_reaches_the_sink_and_p_reports_the_link(pair, monkeypatch):
    """Issue 16: D's pull carries its mode's ranking class (speculative: split, full: whole); P's worker measures
    the link from the reads D completed and reports it with the bytes still staged (auto's inputs)."""
    make, _ = pair
    (p, _), (d, _) = make("kv_producer", mode="speculative"), make("kv_consumer", mode="speculative")
    orders: dict[str, str] = {}
    real_pull = d.sink.pull
    monkeypatch.setattr(d.sink, "pull", lambda req_id, *a, order="split", **kw: (
        orders.__setitem__(req_id, order), real_pull(req_id, *a, order=order, **kw))[1])
    for req, mode in (("p1", "speculative"), ("p2", "full")):
        publish(p, mode, req)
    p.take_worker_meta()  # the first report (nothing read yet)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative", "d1", "p1"),
                                                     recv_spec(p, "full", "d2", "p2")]))
    done: set[str] = set()
    poll_until([p, d], lambda: done.update(d.take_results()[0]) or {"d1", "d2"} <= done)
    poll_until([p, d], lambda: p.source.stats()["requests_live"] == 0)
    assert orders == {"d1": "split", "d2": "whole"}
    time.sleep(0.11)
    p.poll()
    meta = p.take_worker_meta()
    assert meta is not None and meta.p_link is not None
    rate, queued, encode_s = meta.p_link
    assert rate > 0 and queued == 0 and encode_s > 0  # both Lynx encodes measured


def test_concurrent_flow_takes_d_staging_only_once_p_staged_the_request(pair):
    """Issue 15 concurrent flow: D learns of requests before P has them; it holds no staging for them until P
    has staged each (a burst larger than D's pool would else fill it with requests P has not started, while
    P's pool fills with requests waiting for D), then serves them in the order P staged them."""
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer")
    tickets = {f"p{i}": mint_ticket() for i in (1, 2)}
    specs = [dataclasses.replace(recv_spec(p, "full", req=f"d{i}", remote=f"p{i}"), transfer_id=tickets[f"p{i}"][0],
                                 token=tickets[f"p{i}"][1], concurrent=True) for i in (1, 2)]
    need = sum(d._pull_layout(specs[0]).nbytes)
    d_fill = d.sink.pool.alloc_request("filler", d.sink.pool.nbytes - need - need // 2, 0)  # room for one
    d.start_load(LynxConnectorMetadata(reqs_to_recv=specs))
    for _ in range(20):
        d.poll()
        time.sleep(0.01)
    assert set(d._recvs) == {"d1", "d2"} and d.sink.pool.regions_live == 1  # the filler only: nothing held
    assert d.take_results() == (set(), set())
    done: set[str] = set()
    for i in (2, 1):  # P stages p2 first: D serves it while d1 still holds nothing
        tid, tok = tickets[f"p{i}"]
        p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id=f"p{i}", block_ids=P_BLOCKS, num_tokens=N,
                                                             mode="full", transfer_id=tid, token=tok)]))
        poll_until([p, d], lambda i=i: done.update(d.take_results()[0]) or f"d{i}" in done)
        assert done == ({"d2"} if i == 2 else {"d1", "d2"})
        assert d.sink.pool.regions_live == 1  # the filler again
    want = expected(p_caches, "full", full=True)
    assert all(torch.equal(d_caches[n], want[n]) for n in d_caches)
    del d_fill
    d.sink.pool.free_request("filler")
    assert_staging_freed(p, d)


def test_concurrent_flow_request_aborted_before_p_staged_it_frees_both_sides(pair):
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    tid, tok = mint_ticket()
    spec = dataclasses.replace(recv_spec(p, "full", remote="p1"), transfer_id=tid, token=tok, concurrent=True)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[spec]))
    d.poll()
    d.start_load(LynxConnectorMetadata(recv_aborted={"d1"}))
    assert d.take_results()[0] == {"d1"}  # vLLM frees its blocks now
    p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id="p1", block_ids=P_BLOCKS, num_tokens=N,
                                                         mode="full", transfer_id=tid, token=tok)]))
    assert_staging_freed(p, d)  # P's staging freed by D's Done (owed until P has the request), not its lease


def test_concurrent_speculative_pull_reports_p_first_token_in_worker_meta(pair):
    """Concurrent flow (issue 15): P's worker learns its first token a step after the prompt (the connector's
    bind_connector_metadata), names it on the side channel, and D's worker reports it to its scheduler half once,
    even when every byte was readable before (D's reads still in flight)."""
    make, fabric = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer")
    tid, token = mint_ticket()  # the proxy's
    d_nixl = next(a for n, a in fabric.agents.items() if n.endswith("-dst"))
    d_nixl.hang = True  # D's READs stay in flight
    spec = dataclasses.replace(recv_spec(p, "speculative", remote="p-new"), transfer_id=tid, token=token,
                               concurrent=True)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[spec]))
    p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id="p1", block_ids=P_BLOCKS, num_tokens=N,
                                                        mode="speculative", transfer_id=tid, token=token)]))
    poll_until([p, d], lambda: d.sink.stats()["bytes_done"] == 0 and p.source.stats()["served_queries"] >= 2)
    assert d.take_worker_meta() is None  # P has not sampled yet
    p.announce_first_tokens({tid: 4242, "ef" * 16: 1})  # (a transfer D freed already: skipped)
    tokens: dict[str, int] = {}
    poll_until([p, d], lambda: tokens.update(getattr(d.take_worker_meta(), "first_tokens", {})) or bool(tokens))
    assert tokens == {"d1": 4242}
    d_nixl.hang = False
    merged: set[str] = set()
    poll_until([p, d], lambda: merged.update(getattr(d.take_worker_meta(), "residual_merged", ())) or "d1" in merged)
    full = expected(p_caches, "speculative", full=True)
    assert all(torch.equal(d_caches[n], full[n]) for n in d_caches)
    assert d.take_worker_meta() is None  # reported once
    assert_staging_freed(p, d)


@pytest.mark.parametrize("p_choice", ["bf16", "speculative"])
def test_concurrent_auto_pull_is_sized_and_served_by_the_mode_p_names(pair, p_choice):
    """Auto in the concurrent flow (protocol v3): D pulls without knowing the mode, provisionally as the Lynx mode
    it would serve (speculative); P's Regions name its choice, which sizes D's staging and decides how D writes:
    the passthrough once, bit for bit; a Lynx choice as D's speculative pull. D reports the mode served once."""
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer")
    tid, token = mint_ticket()
    spec = dataclasses.replace(recv_spec(p, "speculative", remote="p-new"), transfer_id=tid, token=token,
                               concurrent=True, auto=True)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[spec]))
    d.poll()
    reason = "fast_link" if p_choice == "bf16" else "slow_link"
    p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id="p1", block_ids=P_BLOCKS, num_tokens=N,
                                                        mode=p_choice, transfer_id=tid, token=token,
                                                        auto_reason=reason)]))
    auto: dict[str, tuple[str, str, str]] = {}
    merged: set[str] = set()
    done: set[str] = set()

    def finished() -> bool:
        meta = d.take_worker_meta()
        if meta is not None:
            assert not auto or not meta.auto_modes, "reported once"
            auto.update(meta.auto_modes)
            merged.update(meta.residual_merged)
        done.update(d.take_results()[0])
        return "d1" in done and (p_choice == "bf16" or "d1" in merged)

    poll_until([p, d], finished)
    assert auto == {"d1": (p_choice, reason, p_choice)}
    want = expected(p_caches, p_choice, full=p_choice != "bf16")
    assert all(torch.equal(d_caches[n], want[n]) for n in d_caches)
    if p_choice == "bf16":  # the passthrough: P's full blocks, bit for bit
        assert all(torch.equal(d_caches[n][D_BLOCKS[:2]], p_caches[n][P_BLOCKS[:2]]) for n in d_caches)
    assert_staging_freed(p, d)


def test_concurrent_auto_pull_fails_when_p_names_a_mode_d_does_not_allow(pair):
    """P staged it under a mode D's allowed_modes do not let auto pick (here int8): that request's load fails
    with the mode named, nothing is written, and both sides free their staging."""
    make, _ = pair
    (p, _), (d, d_caches) = make("kv_producer", allowed_modes="all"), make("kv_consumer")
    tid, token = mint_ticket()
    spec = dataclasses.replace(recv_spec(p, "full", remote="p-new"), transfer_id=tid, token=token,
                               concurrent=True, auto=True)
    errors = load_errors(d)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[spec]))
    p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id="p1", block_ids=P_BLOCKS, num_tokens=N,
                                                        mode="int8", transfer_id=tid, token=token)]))
    failed: set[str] = set()
    poll_until([p, d], lambda: failed.update(d.take_results()[1]) or "d1" in failed)
    assert "as mode 'int8', not one of the modes this pull accepts" in errors["d1"]
    assert all(not c.any() for c in d_caches.values())
    assert_staging_freed(p, d)


def test_an_empty_step_waits_for_a_pull_to_land_only_while_one_is_in_flight(pair):
    """``idle_wait_s``: on a step with nothing to compute (``meta.idle``) D's worker blocks in the sink's wait while
    a pull is in flight, never when nothing is in flight, when the step computes, or when it starts pulls; and the
    pull it waited for is applied by the same step's poll."""
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer", idle_wait_s=0.5)
    waits: list[float] = []
    real_wait = d.sink.wait
    d.sink.wait = lambda timeout: waits.append(timeout) or real_wait(timeout)  # type: ignore[method-assign]
    d.wait_idle(LynxConnectorMetadata(idle=True))
    assert waits == []  # nothing in flight
    publish(p, "full")
    start = LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full")], idle=True)
    d.start_load(start)
    d.wait_idle(start)
    d.wait_idle(LynxConnectorMetadata(idle=False))
    assert waits == []  # a step that starts pulls, or computes, never waits
    done: set[str] = set()
    end = time.monotonic() + 10
    while "d1" not in done:
        assert time.monotonic() < end, "pull did not land"
        p.poll()
        d.wait_idle(LynxConnectorMetadata(idle=True))
        d.poll()
        done.update(d.take_results()[0])
    assert waits and all(w == 0.5 for w in waits)
    assert_staging_freed(p, d)


def test_encode_time_counts_the_codec_not_the_forward_between_layers(pair):
    """Layer-wise publish encodes each layer inside P's forward: ``Avg encode`` is the codec's (and checksums')
    time summed over the layers, not the wall time from the first layer to the last (the forward's)."""
    make, _ = pair
    p, caches = make("kv_producer")
    meta = LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id="p1", block_ids=P_BLOCKS, num_tokens=N, mode="full")])
    forward_s = 0.25
    for name in caches:  # what vLLM does: save_kv_layer after each attention layer, the forward in between
        p.save_layer(name, meta)
        time.sleep(forward_s)
    p.save(meta)
    encodes = p.stats.data["encode_s"]
    assert len(encodes) == 1 and p.source.stats()["regions_live"] > 0  # staged, waiting for D
    assert 0.0 < encodes[0] < forward_s, encodes


def test_a_settled_speculative_end_is_forgotten(pair):
    """Once the scheduler half names a request in spec_settled (every worker merged, or one failed), a later
    recv_aborted for it (an ordinary end: the scheduler half asks nothing then) reports nothing twice."""
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer", residual_grace_s=0)
    paced_events(d, 1)
    publish(p, "speculative")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")],
                                       test_hooks={"d1": {"delay_residual_steps": 2}}))
    done: set[str] = set()
    poll_until([p, d], lambda: done.update(d.take_results()[0]) or "d1" in done)
    merged: set[str] = set()
    poll_until([p, d], lambda: merged.update(getattr(d.take_worker_meta(), "residual_merged", ())) or "d1" in merged)
    assert "d1" in d._ended_on_anchor
    d.start_load(LynxConnectorMetadata(spec_settled=["d1"]))
    assert d._ended_on_anchor == {} and d.take_results() == (set(), set())
    assert_staging_freed(p, d)


def test_layerwise_ready_bytes_are_the_sealed_prefix_of_whole_layers():
    """Layer-wise publish (lynx_connector/layerwise.py): only the layers sealed from the first, in order, are
    readable; a layer sealed past a gap (3 before 2) is not, and nothing is before the first seal."""
    sl = StagedLayout(PlaneLayout("anchor", 24, 4), PlaneLayout("residual", 40, 4))
    a, r = sl.nbytes
    staged = SimpleNamespace(anchor=torch.zeros(a, dtype=torch.uint8), residual=torch.zeros(r, dtype=torch.uint8))
    job = StagingJob(req_id="p1", spec=None, codec=None, layout=sl, staged=staged, staging_id="t/0")
    assert job.ready_bytes() == (0, 0)
    for layer in (0, 1, 3):
        job.seal(layer)
    assert job.ready_bytes() == (2 * sl.anchor.stride, 2 * sl.residual.stride)
    job.seal(2)
    assert job.ready_bytes() == sl.nbytes
    # a mode without a residual plane: the residual prefix stays 0
    bare = StagingJob(req_id="p2", spec=None, codec=None, layout=sl.without_residual(),
                      staged=SimpleNamespace(anchor=staged.anchor.clone(), residual=None), staging_id="t/1")
    bare.seal(0)
    assert bare.ready_bytes() == (sl.anchor.stride, 0)


def test_d_shutting_down_tells_p_to_free_the_loads_waiting_for_staging(pair):
    """D shuts down with a load waiting for room in its staging: its P hears a Done at once (the waiting loads got
    nothing, so P held their staging until the lease); loads in flight: tests/transport (the sink's close)."""
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    publish(p, "full", req="p1")
    publish(p, "full", req="p2")
    p.poll()
    d_fill = d.sink.pool.alloc_request("filler", d.sink.pool.nbytes - 4096, 0)  # D's pool is full: p1 waits
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full", "d1", "p1")]))
    assert len(d._recv_waiting) == 1
    del d_fill
    live = p.source.stats()["regions_live"]
    assert live > 0
    t0 = time.monotonic()
    d.shutdown()
    assert time.monotonic() - t0 < 3.0 and d._recv_waiting == {} and d.sink is None
    end = time.monotonic() + 2.0
    while p.source.counters["freed_done"] < 1 and time.monotonic() < end:  # p1's Done: not its 30 s lease
        time.sleep(0.01)
    assert p.source.counters["freed_done"] == 1
