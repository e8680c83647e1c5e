"""The connector's worker half (``LynxConnectorWorker``) on P and D in one process: real codec on real CPU-layout
KV caches, real transport (zmq side channel), the fake NIXL of tests/transport/fakes.py. P encodes and publishes,
D pulls and writes its blocks; every failure releases staging on both sides. The real engines run in
tests/integration."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from lynx_connector import worker as worker_mod
from lynx_connector.codec import decode_anchor, encode, get_codec, merge_residual
from lynx_connector.config import LynxConfig
from lynx_connector.metadata import LynxConnectorMetadata, RecvSpec, SaveSpec, mint_ticket
from lynx_connector.modes import get_mode
from lynx_connector.transport import TransferSink, TransferSource
from tests.transport.fakes import FakeFabric, FakeNixlWrapper

pytestmark = pytest.mark.timeout(60)

BS, H, D, NB, LAYERS = 16, 2, 32, 8, 2
N = 40  # prompt tokens: blocks 0..2, the last one partial
P_BLOCKS, D_BLOCKS = [0, 1, 2], [5, 3, 6]


def vcfg(role: str) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role=role),
                           cache_config=SimpleNamespace(block_size=BS), model_config=SimpleNamespace(model="tiny"))


@pytest.fixture
def pair(monkeypatch):
    fabric = FakeFabric()
    monkeypatch.setattr(worker_mod, "TransferSource", lambda cfg, compat, name=None, **kw: TransferSource(
        cfg, compat, nixl=FakeNixlWrapper(fabric, name), name=name, **kw))
    monkeypatch.setattr(worker_mod, "TransferSink", lambda cfg, compat, name=None, **kw: TransferSink(
        cfg, compat, nixl=FakeNixlWrapper(fabric, name), name=name, **kw))
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
    a, r = codec.plane_nbytes(N, H, D, torch.float32)
    out = {}
    for name, kv in p_caches.items():
        pa, pr = torch.zeros(a, dtype=torch.uint8), torch.zeros(r, dtype=torch.uint8) if r else None
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
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
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
