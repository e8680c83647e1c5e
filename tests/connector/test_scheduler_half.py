"""Scheduler half in isolation, with small fakes for vLLM's Request / KVCacheBlocks / KVCacheManager.
The real thing runs in tests/integration (two real engines exchanging KV)."""

import secrets
from types import SimpleNamespace

import pytest
from vllm.v1.request import RequestStatus

from lynx_connector.config import LynxConfig
from lynx_connector.metadata import LynxHandshakeMetadata, LynxWorkerMeta, RemotePrefill
from lynx_connector.scheduler import LynxConnectorScheduler
from lynx_connector.signing import ParamsSigner, prompt_digest
from lynx_connector.transport.keys import load_side_channel_key

BS = 32


class FakeBlocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


class FakeManager:
    def __init__(self):
        self.blocks = {}

    def get_block_ids(self, req_id):
        return (self.blocks[req_id],)


def make_sched(**extra):
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS))
    s = LynxConnectorScheduler(vcfg, "engine-p", LynxConfig.from_extra_config(extra))
    mgr = FakeManager()
    s.bind_kv_cache_manager(mgr)
    s.set_handshake({0: LynxHandshakeMetadata(host="10.1.2.3", port=5555, tp_rank=0)})
    return s, mgr


def req(req_id, n_prompt, params, computed=0, status=RequestStatus.RUNNING, outputs=()):
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=n_prompt, num_computed_tokens=computed,
                           kv_transfer_params=params, status=status, output_token_ids=list(outputs),
                           num_output_tokens=len(outputs), use_structured_output=False,
                           block_hashes=[bytes([i]) * 32 for i in range(n_prompt // BS)])


def sched_out(**n):
    return SimpleNamespace(num_scheduled_tokens=n)


def remote_params(n=100, **over):
    """Params as P signs them (with this test's deployment key: conftest), ``over`` applied before signing."""
    p = RemotePrefill(transfer_id="a" * 32, token="b" * 32, engine_id="engine-p", request_id="p-1", host="10.1.2.3",
                      ports=(5555,), num_tokens=n, mode="full").to_params()
    p.update(over)
    return ParamsSigner(load_side_channel_key(), 60).sign(p)


def test_prefill_side_encodes_when_prompt_completes_and_returns_params():
    s, mgr = make_sched()
    r = req("p-1", 70, {"do_remote_decode": True})
    mgr.blocks["p-1"] = [7, 3, 9, 11]
    s.update_state_after_alloc(r, FakeBlocks([7, 3, 9]), 0)
    # chunked prefill: first chunk does not complete the prompt -> nothing to save
    assert s.build_connector_meta(sched_out(**{"p-1": 40})).reqs_to_save == []
    r.num_computed_tokens = 40
    meta = s.build_connector_meta(sched_out(**{"p-1": 30}))
    assert [(x.req_id, x.block_ids, x.num_tokens) for x in meta.reqs_to_save] == [("p-1", [7, 3, 9], 70)]
    # saved once only
    assert s.build_connector_meta(sched_out(**{"p-1": 1})).reqs_to_save == []
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    r.output_token_ids, r.num_output_tokens = [4242], 1  # the token P sampled after the prompt
    hold, params = s.request_finished(r, [7, 3, 9])
    # P holds its blocks until the worker reports the request in finished_sending (staged, or given up after
    # waiting for staging room: lynx_connector/saving.py)
    assert hold is True
    rp = RemotePrefill.from_params(params)
    assert (rp.host, rp.ports, rp.request_id, rp.num_tokens) == ("10.1.2.3", (5555,), "p-1", 70)
    assert rp.first_token == 4242 and params["lynx_first_token"] == 4242
    # the capability P's scheduler half minted for the request, the same it handed to its workers
    assert (rp.transfer_id, rp.token) == (meta.reqs_to_save[0].transfer_id, meta.reqs_to_save[0].token)
    assert len(rp.token) == 32 and rp.token != rp.transfer_id


def test_prefill_side_names_requests_preempted_after_their_save():
    """vLLM's preempted_req_ids: a P request preempted after the step that asked for its save is named to the
    workers (save_preempted: one still waiting for staging room is given up); one preempted before its prompt
    completed is not (it is saved when it completes again)."""
    s, mgr = make_sched()
    done, early = req("p-1", 70, {"do_remote_decode": True}), req("p-2", 70, {"do_remote_decode": True})
    for r in (done, early):
        mgr.blocks[r.request_id] = [7, 3, 9]
        s.update_state_after_alloc(r, FakeBlocks([7, 3, 9]), 0)
    assert [x.req_id for x in s.build_connector_meta(sched_out(**{"p-1": 70, "p-2": 30})).reqs_to_save] == ["p-1"]
    out = SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids={"p-1", "p-2"})
    assert s.build_connector_meta(out).save_preempted == ["p-1"]
    assert s.build_connector_meta(sched_out()).save_preempted == []


def test_prefill_side_refuses_a_request_whose_params_d_could_not_carry():
    """A request id over 1024 characters (vLLM takes X-Request-Id unbounded) cannot go into signed params: the
    request gets a 400 lynx_error and its staging is dropped, instead of ParamsRefused out of the engine step."""
    s, mgr = make_sched()
    rid = "p-" + "a" * 1100
    r = req(rid, 70, {"do_remote_decode": True})
    mgr.blocks[rid] = [7, 3, 9]
    s.update_state_after_alloc(r, FakeBlocks([7, 3, 9]), 0)
    assert [x.req_id for x in s.build_connector_meta(sched_out(**{rid: 70})).reqs_to_save] == [rid]
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    r.output_token_ids, r.num_output_tokens = [5], 1
    hold, out = s.request_finished(r, [7, 3, 9])
    assert hold is True and out["lynx_error"]["code"] == 400 and "remote_request_id" in out["lynx_error"]["message"]
    assert s.build_connector_meta(sched_out()).save_aborted == [rid]  # the worker frees it, then its blocks


def test_first_token_is_kept_for_speculative_pulls_only():
    s, _ = make_sched()
    s.speculation_enabled = True
    for rid, mode in (("d-s", "speculative"), ("d-f", "full")):
        r = req(rid, 64, remote_params(64, lynx_mode=mode, lynx_first_token=77))
        r.use_structured_output = False
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, FakeBlocks([1, 2]), 64)
    assert s.spec.first_token == {"d-s": 77}
    r.status = RequestStatus.FINISHED_ABORTED
    s.request_finished(req("d-s", 64, None, status=RequestStatus.FINISHED_ABORTED), [1, 2])
    assert s.spec.first_token == {}
    # P without a sampled token (no outputs): no first token in the params, D holds its first token
    assert "lynx_first_token" not in remote_params(64)


def _served_as(cases):
    """D's scheduler half (with the speculative scheduler) given each (request id, SamplingParams, _) asking for
    speculation: the mode each is served as, and the requests left pending their residual."""
    s, _ = make_sched()
    s.speculation_enabled = True
    for i, (rid, sp, _want) in enumerate(cases):
        r = req(rid, 64, remote_params(64, lynx_mode="speculative", lynx_request_id=f"p-{i}"))
        r.sampling_params = sp
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, FakeBlocks([2 * i, 2 * i + 1]), 64)
    return {spec.req_id: spec.mode for spec in s.build_connector_meta(sched_out()).reqs_to_recv}, s.spec.pending


def test_seeded_sampling_is_served_as_full():
    """A seeded sampled request asking for speculation is served as full (speculation's draws depend on when the
    residual lands: the same seed would not give the same text twice); greedy and unseeded ones speculate."""
    from vllm.sampling_params import SamplingParams

    cases = (("d-seed", SamplingParams(temperature=0.8, seed=7), "full"),
             ("d-random", SamplingParams(temperature=0.8), "speculative"),
             ("d-greedy", SamplingParams(temperature=0.0, seed=7), "speculative"))
    modes, pending = _served_as(cases)
    assert modes == {rid: want for rid, _, want in cases}
    assert pending == {"d-random", "d-greedy"}


def test_min_tokens_requests_are_served_as_full():
    """vLLM's min-tokens processor forgets a request whose output (held tokens included) reached min_tokens and
    does not track it again while it stays in the batch: verification would let it stop before min_tokens. Such
    requests are served as full; the same request without min_tokens speculates."""
    from vllm.sampling_params import SamplingParams

    cases = (("d-min", SamplingParams(temperature=0.0, min_tokens=9, max_tokens=32), "full"),
             ("d-min-sampled", SamplingParams(temperature=0.8, min_tokens=1), "full"),
             ("d-plain", SamplingParams(temperature=0.0, max_tokens=32), "speculative"))
    modes, pending = _served_as(cases)
    assert modes == {rid: want for rid, _, want in cases}
    assert pending == {"d-plain"}


def test_p_hands_its_first_token_to_the_workers_in_the_next_step():
    """Concurrent flow: D's params carry no first token, so P's workers name it on the side channel; they learn it
    from the metadata of the step after the request finished (vLLM runs that step: finished_req_ids)."""
    s, mgr = make_sched()
    r = req("p-9", 40, {"do_remote_decode": True})
    mgr.blocks["p-9"] = [1, 2]
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
    tid = s.build_connector_meta(sched_out(**{"p-9": 40})).reqs_to_save[0].transfer_id
    r.status, r.output_token_ids, r.num_output_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, [31], 1
    s.request_finished(r, [1, 2])
    assert s.build_connector_meta(sched_out()).first_tokens == {tid: 31}
    assert s.build_connector_meta(sched_out()).first_tokens == {}  # once
    aborted = req("p-10", 40, {"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED, outputs=[5])
    mgr.blocks["p-10"] = [3, 4]
    s.update_state_after_alloc(aborted, FakeBlocks([3, 4]), 0)
    s.build_connector_meta(sched_out(**{"p-10": 40}))
    s.request_finished(aborted, [3, 4])
    assert s.build_connector_meta(sched_out()).first_tokens == {}  # aborted: its staging goes, no token


def test_d_keeps_p_first_token_from_the_worker_for_speculating_requests_only():
    s, _ = make_sched()
    s.speculation_enabled = True
    for rid, mode in (("d-s", "speculative"), ("d-f", "full")):
        r = req(rid, 64, remote_params(64, lynx_mode=mode))
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, FakeBlocks([1, 2]), 64)
    assert s.spec.first_token == {}
    meta = LynxWorkerMeta(first_tokens={"d-s": 7, "d-f": 8, "gone": 9})
    s.update_connector_output(SimpleNamespace(finished_recving=set(), kv_connector_worker_meta=meta))
    assert s.spec.first_token == {"d-s": 7}
    other = LynxWorkerMeta(first_tokens={"d-s": 7})  # another rank's worker: the same token
    assert LynxWorkerMeta().aggregate(other).first_tokens == {"d-s": 7}


def test_prefill_side_abort_drops_staging():
    s, mgr = make_sched()
    r = req("p-2", 40, {"do_remote_decode": True})
    mgr.blocks["p-2"] = [1, 2]
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
    s.build_connector_meta(sched_out(**{"p-2": 40}))
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, [1, 2]) == (True, None)  # freed once the worker has dropped its staging
    assert s.build_connector_meta(sched_out()).save_aborted == ["p-2"]


def test_decode_side_loads_prompt_asynchronously():
    s, _ = make_sched()
    r = req("d-1", 100, remote_params(100))
    assert s.get_num_new_matched_tokens(r, 0) == (100, True)
    s.update_state_after_alloc(r, FakeBlocks([5, 6, 7, 8]), 100)
    assert r.kv_transfer_params["do_remote_prefill"] is False  # one transfer per request
    meta = s.build_connector_meta(sched_out())
    (spec,) = meta.reqs_to_recv
    assert (spec.block_ids, spec.num_tokens, spec.skip_blocks, spec.remote_req_id) == ([5, 6, 7, 8], 100, 0, "p-1")
    # a second update_state_after_alloc (after the load) does not start another pull
    s.update_state_after_alloc(r, FakeBlocks([5, 6, 7, 8]), 0)
    assert s.build_connector_meta(sched_out()).reqs_to_recv == []


def test_decode_side_local_prefix_hit_skips_shared_blocks():
    s, _ = make_sched()
    r = req("d-2", 100, remote_params(100))
    assert s.get_num_new_matched_tokens(r, 64) == (36, True)
    s.update_state_after_alloc(r, FakeBlocks([5, 6, 7, 8]), 36)
    (spec,) = s.build_connector_meta(sched_out()).reqs_to_recv
    assert spec.skip_blocks == 2 and spec.num_tokens == 100


def test_decode_side_abort_in_flight_holds_blocks_until_worker_confirms():
    s, _ = make_sched()
    r = req("d-3", 64, remote_params(64))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 64)
    s.build_connector_meta(sched_out())
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, [1, 2]) == (True, None)
    assert s.build_connector_meta(sched_out()).recv_aborted == ["d-3"]


def test_decode_side_abort_before_scheduling_tells_p_only_for_params_that_verify():
    """A request aborted while still waiting (never scheduled, its params never read): D tells the worker to free
    P's staging at once, but only when the params verify; a client's unsigned ones must not make D connect to the
    host they name."""
    good = remote_params(64)
    for params, tells in ((good, True), ({**good, "remote_host": "127.0.0.9"}, False),
                          ({k: v for k, v in good.items() if k != "lynx_sig"}, False)):
        s, _ = make_sched()
        r = req("d-9", 64, dict(params), status=RequestStatus.FINISHED_ABORTED)
        assert s.request_finished(r, []) == (False, None)
        pending = s.build_connector_meta(sched_out()).reqs_to_recv
        assert [(p.remote_host, p.num_tokens) for p in pending] == ([("10.1.2.3", 0)] if tells else []), params


def spec_sched(workers=1):
    """D's scheduler half serving a speculative request "d-4" (running on its anchor), with ``workers`` workers."""
    s, _ = make_sched()
    s.spec.workers = workers
    s.speculation_enabled = True
    r = req("d-4", 64, remote_params(64, lynx_mode="speculative"))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 64)
    s.build_connector_meta(sched_out())
    assert s.spec.pending == {"d-4"}
    return s, r


def step(s, meta, finished=()):
    s.update_connector_output(SimpleNamespace(finished_recving=set(finished), kv_connector_worker_meta=meta))
    return s.build_connector_meta(sched_out())


def test_finished_recving_clears_inflight_and_merged_signal_is_collected():
    s, r = spec_sched()
    out = step(s, LynxWorkerMeta({"d-4"}), finished={"d-4"})
    assert "d-4" in s.spec.merged and s.spec.pending == set() and out.spec_settled == ["d-4"]
    r.status = RequestStatus.FINISHED_STOPPED
    assert s.request_finished(r, [1, 2]) == (False, None)


def test_tensor_parallel_merge_counts_every_worker_over_steps():
    """Two workers merge their shards in different steps (vLLM's aggregator hands the scheduler the first
    non-empty meta, then aggregates the others into it): merged only once both have, never before."""
    s, _ = spec_sched(workers=2)
    step(s, LynxWorkerMeta(set()).aggregate(LynxWorkerMeta({"d-4"})))  # rank 1 merged, rank 0 not yet
    assert s.spec.merged == set() and s.spec.pending == {"d-4"}
    out = step(s, LynxWorkerMeta({"d-4"}))  # rank 0, a later step (rank 1 sends no meta)
    assert s.spec.merged == {"d-4"} and s.spec.pending == set() and out.spec_settled == ["d-4"]


def test_tensor_parallel_residual_failure_on_one_worker_cancels_the_others():
    """One worker's residual fails: the policy applies (residual_failed) and the other workers' pulls are
    cancelled before the blocks can be freed or reused, so no shard is merged into blocks of another request."""
    s, _ = spec_sched(workers=2)
    step(s, LynxWorkerMeta({"d-4"}))  # rank 0 merged
    out = step(s, LynxWorkerMeta(residual_failed={"d-4"}))  # rank 1 failed
    assert s.spec.failed == {"d-4"} and s.spec.merged == set() and s.spec.pending == set()
    assert out.recv_cancelled == ["d-4"] and out.spec_settled == ["d-4"] and s.spec._counts == {}


@pytest.mark.parametrize("bad", [
    {"lynx_version": 99},
    {"remote_port": "5555", "lynx_ports": "x"},
    {"remote_num_tokens": -3},
    {"remote_host": ""},
    {"lynx_ports": [0]},
    {"remote_request_id": 12},
    {"lynx_first_token": "7"},
    {"lynx_first_token": -1},
    {"lynx_first_token": True},
    {"lynx_transfer_id": None},
    {"lynx_token": "B" * 32},
    {"lynx_token": "b" * 31},
    {"lynx_transfer_id": "x" * 32},
    {"lynx_version": 1},
    {"lynx_kv_dtype": "float64"},
    {"lynx_kv_dtype": 16},
])
def test_malformed_params_fall_back_to_local_prefill(bad):
    s, _ = make_sched()
    r = req("d-5", 64, remote_params(64, **bad))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert r.kv_transfer_params["do_remote_prefill"] is False


def test_worker_meta_aggregates_merges_as_counts_across_ranks():
    a, b, c = LynxWorkerMeta({"x", "y"}), LynxWorkerMeta({"y"}), LynxWorkerMeta(residual_failed={"x"})
    agg = a.aggregate(b).aggregate(c)
    assert agg.merge_counts() == {"x": 1, "y": 2} and agg.residual_failed == {"x"}
    assert LynxWorkerMeta({"z"}).merge_counts() == {"z": 1}



def test_a_prefill_whose_workers_differ_in_host_or_cache_dtype_is_refused_at_start():
    """D is told one host and one cache dtype for all of P's ranks: ranks on two hosts had D dial rank 1's port on
    rank 0's host."""
    s, _ = make_sched()
    for a, b in (({"host": "10.0.0.1"}, {"host": "10.0.0.2"}), ({"kv_dtype": "bfloat16"}, {"kv_dtype": "float32"})):
        metas = {0: LynxHandshakeMetadata(**{"host": "10.0.0.1", "port": 5600, "tp_rank": 0, **a}),
                 1: LynxHandshakeMetadata(**{"host": "10.0.0.1", "port": 5601, "tp_rank": 1, **b})}
        with pytest.raises(ValueError, match="workers of this prefill instance differ in"):
            s.set_handshake(metas)


def test_decode_side_pulls_from_the_port_of_its_tensor_parallel_rank():
    s, _ = make_sched()
    r = req("d-tp", 64, remote_params(64, lynx_ports=[7001, 7002]))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 64)
    (spec,) = s.build_connector_meta(sched_out()).reqs_to_recv
    assert spec.remote_ports == (7001, 7002)
    assert [spec.port_for_rank(k, 2) for k in (0, 1)] == [7001, 7002]  # P's ports need not be consecutive
    for rank, size in ((2, 2), (0, 1), (0, 4)):  # P's size is its ports': another one of D's is refused
        with pytest.raises(ValueError, match="P runs tensor-parallel size 2, this decode instance"):
            spec.port_for_rank(rank, size)


# ---- issue 14.6: D trusts only its prefill instances -------------------------------------------------------------
def _refused_locally(s, r, reason, discard=False):
    """D refuses ``r``'s params: nothing is loaded (the prompt is computed locally), nothing is pulled, the
    refusal is counted and reported in the request's response. ``discard``: params of this deployment that only
    expired: an empty load tells P to free its staging now (a Done), not at its lease."""
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    assert r.kv_transfer_params["do_remote_prefill"] is False
    recv = [(x.num_tokens, x.block_ids, x.transfer_id) for x in s.build_connector_meta(sched_out()).reqs_to_recv]
    assert recv == ([(0, [], r.kv_transfer_params["lynx_transfer_id"])] if discard else []), recv
    r.status = RequestStatus.FINISHED_STOPPED
    hold, out = s.request_finished(r, [])
    assert hold is False and out["lynx_error"]["reason"] == reason, out
    assert s.stats.data[f"refused_{reason}"] == 1
    assert (s._verified, s._refused, s._recv_inflight) == ({}, {}, set())  # nothing left behind


def test_decode_refuses_unsigned_tampered_and_foreign_params():
    good = remote_params(64)
    for case, params, reason in (
        ("unsigned", {k: v for k, v in good.items() if k != "lynx_sig"}, "unsigned"),
        ("redirected", {**good, "remote_host": "127.0.0.1", "lynx_ports": [1]}, "bad_signature"),
        ("more tokens", {**good, "remote_num_tokens": 4096}, "bad_signature"),
        ("extended", {**good, "lynx_expires": good["lynx_expires"] + 3600}, "bad_signature"),
        ("non-ascii", {**good, "lynx_sig": "\u00e9" * 64}, "bad_signature"),  # compare_digest raised TypeError
        ("upper-case", {**good, "lynx_sig": good["lynx_sig"].upper()}, "bad_signature"),
    ):
        s, _ = make_sched()
        _refused_locally(s, req(f"d-{case}", 64, dict(params)), reason)


def test_decode_refuses_expired_params_and_modes_it_does_not_allow():
    s, _ = make_sched()
    params = remote_params(64)
    # D's clock 61 s after P signed them with a 60 s validity (remote_params)
    s._signer = ParamsSigner(load_side_channel_key(), 60, clock=lambda: params["lynx_expires"] + 1)
    _refused_locally(s, req("d-exp", 64, params), "expired", discard=True)
    s, _ = make_sched()  # default allowed_modes: full, speculative, bf16
    _refused_locally(s, req("d-int4", 64, remote_params(64, lynx_mode="int4")), "mode_not_allowed")
    s, _ = make_sched(allowed_modes="full,int4")
    r = req("d-int4-ok", 64, remote_params(64, lynx_mode="int4"))
    assert s.get_num_new_matched_tokens(r, 0) == (64, True)


def test_decode_refuses_params_signed_for_another_prompt():
    ids = list(range(64))
    s, _ = make_sched()
    r = req("d-p", 64, remote_params(64, lynx_prompt_sha=prompt_digest(ids)))
    r.prompt_token_ids = ids[:63] + [999]
    _refused_locally(s, r, "prompt_mismatch")
    s, _ = make_sched()
    r = req("d-p2", 64, remote_params(64, lynx_prompt_sha=prompt_digest(ids)))
    r.prompt_token_ids = ids
    assert s.get_num_new_matched_tokens(r, 0) == (64, True)


def test_prefill_signs_what_it_returns_bound_to_the_prompt():
    s, mgr = make_sched()
    r = req("p-s", 64, {"do_remote_decode": True})
    r.prompt_token_ids = list(range(64))
    mgr.blocks["p-s"] = [1, 2]
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
    s.build_connector_meta(sched_out(**{"p-s": 64}))
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = s.request_finished(r, [1, 2])
    ParamsSigner(load_side_channel_key(), 60).verify(params)
    assert params["lynx_prompt_sha"] == prompt_digest(r.prompt_token_ids)
    d, _ = make_sched()
    rd = req("d-s", 64, dict(params))
    rd.prompt_token_ids = list(range(64))
    assert d.get_num_new_matched_tokens(rd, 0) == (64, True)  # a D of the same deployment accepts them


@pytest.mark.parametrize("mode, reason", [("int4", "not allowed"), ("int3", "not a transfer mode")])
def test_prefill_refuses_a_mode_the_operator_does_not_allow(mode, reason):
    s, mgr = make_sched()
    r = req("p-m", 64, {"do_remote_decode": True, "lynx_mode": mode})
    mgr.blocks["p-m"] = [1, 2]
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
    assert s.build_connector_meta(sched_out(**{"p-m": 64})).reqs_to_save == []  # never staged
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = s.request_finished(r, [1, 2])
    assert hold is False  # blocks freed at once
    err = params["lynx_error"]
    assert err["code"] == 400 and reason in err["message"] and "do_remote_prefill" not in params
    assert s.stats.data["refused_mode_not_allowed"] == 1
    s2, mgr2 = make_sched(allowed_modes=["full", "int4"])
    r2 = req("p-m2", 64, {"do_remote_decode": True, "lynx_mode": "int4"})
    mgr2.blocks["p-m2"] = [1, 2]
    s2.update_state_after_alloc(r2, FakeBlocks([1, 2]), 0)
    assert [x.mode for x in s2.build_connector_meta(sched_out(**{"p-m2": 64})).reqs_to_save] == ["int4"]


@pytest.mark.parametrize("mode, fenced", [("full", False), ("bf16", False), ("anchor", True), ("int4", True),
                                          ("fp8", True), ("int8", True)])
def test_lossy_loads_get_private_block_hashes(mode, fenced):
    s, _ = make_sched(allowed_modes="all")
    r = req("d-f", 128, remote_params(128, lynx_mode=mode))
    before = list(r.block_hashes)
    assert s.get_num_new_matched_tokens(r, 64) == (64, True)  # two blocks hit D's own prefix cache
    s.update_state_after_alloc(r, FakeBlocks([5, 6, 7, 8]), 64)
    assert r.block_hashes[:2] == before[:2]  # the local hit stays shared
    if fenced:
        assert all(a != b and len(a) == len(b) for a, b in zip(r.block_hashes[2:], before[2:], strict=True))
    else:
        assert r.block_hashes == before


def test_insecure_deployments_sign_with_the_empty_key(monkeypatch):
    monkeypatch.delenv("LYNX_SIDE_CHANNEL_KEY")
    p, mgr = make_sched(insecure_side_channel=True)
    r = req("p-i", 64, {"do_remote_decode": True})
    mgr.blocks["p-i"] = [1, 2]
    p.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
    p.build_connector_meta(sched_out(**{"p-i": 64}))
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.request_finished(r, [1, 2])
    ParamsSigner(None, 60).verify(params)  # the empty key: forgeable by anyone (docs: local tests only)
    d, _ = make_sched(insecure_side_channel=True)
    assert d.get_num_new_matched_tokens(req("d-i", 64, dict(params)), 0) == (64, True)
    monkeypatch.setenv("LYNX_SIDE_CHANNEL_KEY", secrets.token_hex(32))
    secure, _ = make_sched()  # a keyed D refuses what an insecure P signed
    _refused_locally(secure, req("d-i2", 64, dict(params)), "bad_signature")


def test_p_announces_its_cache_dtype_and_d_pulls_with_it():
    """Heterogeneous P and D (issue 18.4): P's workers report their KV cache dtype at start-up, P's params carry
    it (lynx_kv_dtype), D's pull spec follows it (the passthrough's plane is sized and read by it)."""
    s, mgr = make_sched()
    s.set_handshake({0: LynxHandshakeMetadata(host="10.1.2.3", port=5555, tp_rank=0, kv_dtype="bfloat16")})
    r = req("p-dt", 40, {"do_remote_decode": True})
    mgr.blocks["p-dt"] = [1, 2]
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
    s.build_connector_meta(sched_out(**{"p-dt": 40}))
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = s.request_finished(r, [1, 2])
    assert params["lynx_kv_dtype"] == "bfloat16"
    d, _ = make_sched()
    rd = req("d-dt", 40, dict(params))
    d.get_num_new_matched_tokens(rd, 0)
    d.update_state_after_alloc(rd, FakeBlocks([4, 5]), 40)
    (spec,) = d.build_connector_meta(sched_out()).reqs_to_recv
    assert spec.kv_dtype == "bfloat16"
    assert "lynx_kv_dtype" not in remote_params(64)  # not announced: D assumes its own dtype


def test_a_consumer_only_engine_has_no_side_channel_to_announce():
    """kv_role=kv_consumer: every worker returns no handshake metadata and vLLM hands the scheduler half {}
    (engine core: the list of Nones is non-empty): start-up goes on (it raised IndexError)."""
    s, _ = make_sched()
    s.set_handshake({})
    assert s._side_channel_ports == [5555]  # what make_sched announced, unchanged
