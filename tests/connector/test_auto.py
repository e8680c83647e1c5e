"""``auto`` (lynx_connector/auto.py, issue 16.3): the rule, P's link meter, and the scheduler half choosing per
request, signing the choice and D reporting it. The real engines: tests/integration/test_servers.py."""

from types import SimpleNamespace

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.request import RequestStatus

from lynx_connector.auto import (
    AUTO_REASONS,
    AutoEstimator,
    AutoPolicy,
    AutoRequest,
    LinkMeter,
    LinkView,
    choose,
)
from lynx_connector.codec import get_codec
from lynx_connector.config import LynxConfig
from lynx_connector.metadata import LynxHandshakeMetadata, LynxWorkerMeta, RemotePrefill
from lynx_connector.modes import auto_candidates, get_mode
from lynx_connector.scheduler import LynxConnectorScheduler
from lynx_connector.signing import ParamsSigner
from lynx_connector.transport.keys import load_side_channel_key
from tests.connector.test_scheduler_half import BS, FakeBlocks, FakeManager, sched_out

GEOMETRY = (3, 64, 30)  # the lab model: 3 KV heads of 64, 30 layers
CANDIDATES = ("full", "speculative", "bf16")


def inputs(tokens: int, early: bool = True, prefill_s: float = 0.0, codec_s: float = 0.0) -> AutoRequest:
    est = AutoEstimator(None, GEOMETRY, get_codec("lynx"))
    base = est.request(CANDIDATES, tokens, torch.float32, early)
    return AutoRequest(base.first_bytes, early, prefill_s, codec_s)


def test_candidates_are_the_full_precision_modes_only():
    assert set(auto_candidates()) == {"bf16", "full", "speculative"}
    assert all(get_mode(m).full_precision for m in auto_candidates())
    cfg = LynxConfig.from_extra_config({"mode": "auto", "allowed_modes": "all"})
    assert set(cfg.auto_modes) == {"bf16", "full", "speculative"}  # int8, int4, fp8, anchor never


def test_plane_sizes_are_the_codecs():
    req = inputs(1024)
    a, r = get_codec("lynx").plane_nbytes(1024, 3, 64, torch.float32)
    assert req.first_bytes["speculative"] == 30 * a and req.first_bytes["full"] == 30 * (a + r)
    assert req.first_bytes["bf16"] == 30 * 2 * 1024 * 3 * 64 * 4  # fp32 cache: the passthrough moves 4 bytes


def test_fast_link_passthrough_slow_link_speculation():
    req = inputs(1024, codec_s=0.02)
    fast = choose(CANDIDATES, LinkView(100e9 / 8, "configured"), req, speculation=True)
    assert (fast.mode, fast.reason) == ("bf16", "fast_link")
    slow = choose(CANDIDATES, LinkView(0.5e9 / 8, "configured"), req, speculation=True)
    assert (slow.mode, slow.reason) == ("speculative", "slow_link")
    assert slow.estimates["speculative"] < slow.estimates["full"] < slow.estimates["bf16"]
    # the crossover follows the codec's cost: the bytes saved must pay for it
    saved = (req.first_bytes["bf16"] - req.first_bytes["speculative"])
    just_fast = saved / (0.9 * 0.02)  # saving 0.9x the codec time: passthrough still wins
    assert choose(CANDIDATES, LinkView(just_fast, "measured"), req, True).mode == "bf16"
    assert choose(CANDIDATES, LinkView(saved / (1.1 * 0.02), "measured"), req, True).mode == "speculative"


def test_held_first_token_or_no_speculative_scheduler_picks_full_on_a_slow_link():
    slow = LinkView(0.5e9 / 8, "configured")
    for early, spec in ((False, True), (True, False)):
        c = choose(CANDIDATES, slow, inputs(1024, early=early), speculation=spec)
        assert (c.mode, c.reason) == ("full", "slow_link_no_speculation")


def test_no_rate_is_passthrough_and_one_candidate_is_that_one():
    c = choose(CANDIDATES, LinkView(None, "none"), inputs(512), True)
    assert (c.mode, c.reason) == ("bf16", "no_link_rate")
    c = choose(("full",), LinkView(1e6, "configured"), inputs(512), True)
    assert (c.mode, c.reason) == ("full", "only_choice")
    with pytest.raises(ValueError):
        choose((), LinkView(None, "none"), inputs(1), True)


def test_a_tie_goes_to_the_lossless_passthrough():
    """Equal estimates: the passthrough (lossless) wins over a Lynx mode, whichever comes first in the table."""
    req = AutoRequest({"full": 1000, "speculative": 1000, "bf16": 1000}, early_first_token=True)
    link = LinkView(1000.0, "configured")
    for spec in (True, False):
        c = choose(CANDIDATES, link, req, speculation=spec)
        assert (c.mode, c.reason) == ("bf16", "fast_link")
        assert len(set(c.estimates.values())) == 1  # a real tie
    assert choose(("full", "bf16"), link, req, speculation=False).mode == "bf16"

def test_a_queue_on_the_link_favours_the_anchor_that_jumps_it():
    """At a rate where passthrough wins on an idle link, a queue that will not drain during the prefill makes
    speculation win (its anchor goes before the queued whole requests on D: transport/ranking.py)."""
    req = inputs(1024, prefill_s=0.05, codec_s=0.02)
    saved = req.first_bytes["bf16"] - req.first_bytes["speculative"]
    rate = saved / (0.5 * 0.02)  # the bytes saved are worth half the codec time: passthrough on an idle link
    assert choose(CANDIDATES, LinkView(rate, "measured", 0), req, True).mode == "bf16"
    assert choose(CANDIDATES, LinkView(rate, "measured", int(rate * 0.04)), req, True).mode == "bf16"  # drains
    busy = choose(CANDIDATES, LinkView(rate, "measured", int(rate * 0.5)), req, True)
    assert (busy.mode, busy.reason) == ("speculative", "slow_link")


def test_a_reported_queue_drains_at_the_link_rate():
    """P's workers report on steps only: an idle P's last report is old, its queue has drained since."""
    now = [0.0]
    est = AutoEstimator(1e6, GEOMETRY, get_codec("lynx"), clock=lambda: now[0])
    est.observe_link(None, 3_000_000, 0.0)
    assert est.link().queued_bytes == 3_000_000
    now[0] = 1.0
    assert est.link() == LinkView(1e6, "configured", 2_000_000)
    now[0] = 10.0
    assert est.link().queued_bytes == 0


def test_prefill_average_is_seeded_by_its_first_sample_then_smoothed():
    """P's prefill seconds per token: the first finished prompt sets it (no ramp up from 0), later ones move it by
    ALPHA; an unprefilled or unknown request changes nothing."""
    now = [0.0]
    est = AutoEstimator(1e6, GEOMETRY, get_codec("lynx"), clock=lambda: now[0])
    est.started("a", 100)
    now[0] = 1.0
    est.finished("a", prefilled=True)
    assert est.prefill_s_per_token == pytest.approx(0.01)
    est.started("b", 100)
    now[0] = 4.0
    est.finished("b", prefilled=True)  # 0.03 s per token
    assert est.prefill_s_per_token == pytest.approx(0.01 + AutoEstimator.ALPHA * 0.02)
    est.started("c", 100)
    now[0] = 100.0
    est.finished("c", prefilled=False)
    est.finished("never-started", prefilled=True)
    assert est.prefill_s_per_token == pytest.approx(0.01 + AutoEstimator.ALPHA * 0.02)
    assert est.request(CANDIDATES, 50, torch.float32, True).prefill_s == pytest.approx(50 * est.prefill_s_per_token)


def test_codec_cost_counts_p_encode_and_d_decode():
    """The workers report P's Lynx encode seconds per token; D decodes about as long, so the estimate is twice
    that; a report without a measurement (0) keeps the last one."""
    est = AutoEstimator(1e6, GEOMETRY, get_codec("lynx"))
    est.observe_link(None, 0, 1e-5)
    assert est.codec_s_per_token == pytest.approx(2e-5)
    est.observe_link(None, 0, 0.0)
    assert est.codec_s_per_token == pytest.approx(2e-5)
    assert est.request(CANDIDATES, 1000, torch.float32, True).codec_s == pytest.approx(2e-2)

def test_link_meter_adds_the_link_times_d_measured():
    """Samples are (Done's arrival, D's link seconds, bytes); D already shared its busy time among transfers it
    read together, so the meter adds them up; unmeasured ones (0 s) are not counted."""
    now = [100.0]
    m = LinkMeter(window_s=10.0, clock=lambda: now[0])
    assert m.rate() is None
    m.add([(93.0, 1.5, 2000), (94.0, 0.5, 2000), (97.0, 2.0, 1000), (98.0, 0.0, 5000)])
    assert m.rate() == pytest.approx(5000 / 4)
    now[0] = 104.5  # the first two are out of the window
    assert m.rate() == pytest.approx(1000 / 2)
    now[0] = 200.0
    assert m.rate() is None


# ---- the scheduler half -----------------------------------------------------------------------------------
def make_p(kv_role="kv_both", **extra):
    mc = SimpleNamespace(get_num_kv_heads=lambda pc: 3, get_head_size=lambda: 64, get_num_layers=lambda pc: 30,
                         dtype=torch.float32)
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), model_config=mc, parallel_config=None,
                           kv_transfer_config=SimpleNamespace(kv_role=kv_role))
    s = LynxConnectorScheduler(vcfg, "engine-p", LynxConfig.from_extra_config({"mode": "auto", **extra}))
    mgr = FakeManager()
    s.bind_kv_cache_manager(mgr)
    s.set_handshake({0: LynxHandshakeMetadata(host="10.1.2.3", port=5555, tp_rank=0, kv_dtype="float32")})
    return s, mgr


def p_req(req_id, n, params, temperature=0.0):
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=n, num_computed_tokens=0, kv_transfer_params=params,
                           status=RequestStatus.RUNNING, output_token_ids=[], num_output_tokens=0,
                           use_structured_output=False, prompt_token_ids=list(range(n)),
                           sampling_params=SamplingParams(temperature=temperature, max_tokens=4))


def serve_on_p(s, mgr, r):
    mgr.blocks[r.request_id] = list(range(-(-r.num_prompt_tokens // BS)))
    s.update_state_after_alloc(r, FakeBlocks(mgr.blocks[r.request_id]), 0)
    meta = s.build_connector_meta(sched_out(**{r.request_id: r.num_prompt_tokens}))
    r.status, r.output_token_ids, r.num_output_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, [7], 1
    _, params = s.request_finished(r, [])
    return meta.reqs_to_save[0].mode, params


def test_p_chooses_per_request_signs_the_choice_and_counts_it():
    s, mgr = make_p(link_gbps=0.5)
    mode, params = serve_on_p(s, mgr, p_req("r1", 1024, {"do_remote_decode": True, "lynx_mode": "auto"}))
    s.speculation_enabled = True  # P runs the speculative scheduler (the lynx:auto preset)
    mode2, params2 = serve_on_p(s, mgr, p_req("r2", 1024, {"do_remote_decode": True}))  # the instance's auto
    mode3, params3 = serve_on_p(s, mgr, p_req("r3", 1024, {"do_remote_decode": True}, temperature=0.8))
    assert (mode, mode2, mode3) == ("full", "speculative", "full")
    rp = RemotePrefill.from_params(params2)
    assert (rp.mode, rp.auto_reason) == ("speculative", "slow_link")
    ParamsSigner(load_side_channel_key(), 60).verify(params2)
    with pytest.raises(Exception, match="lynx_sig"):  # the choice is signed: D cannot be told another one
        ParamsSigner(load_side_channel_key(), 60).verify({**params2, "lynx_auto": "fast_link"})
    assert [tuple(x) for x in s.stats.data["auto"]] == [("full", "slow_link_no_speculation"),
                                                       ("speculative", "slow_link"),
                                                       ("full", "slow_link_no_speculation")]
    assert all(reason in AUTO_REASONS for _, reason in s.stats.data["auto"])


def test_a_prefill_only_p_assumes_its_ds_speculate():
    """kv_role kv_producer: the speculative preset installs no scheduler on P (speculation_enabled stays False),
    and auto counts on its Ds running the preset's; auto_speculative still decides when set."""
    s, mgr = make_p(kv_role="kv_producer", link_gbps=0.5)
    assert s.speculation_enabled is False
    assert serve_on_p(s, mgr, p_req("r1", 1024, {"do_remote_decode": True}))[0] == "speculative"
    s, mgr = make_p(kv_role="kv_producer", link_gbps=0.5, auto_speculative=False)
    assert serve_on_p(s, mgr, p_req("r2", 1024, {"do_remote_decode": True}))[0] == "full"


def test_auto_speculative_overrides_p_own_scheduler():
    s, mgr = make_p(link_gbps=0.5, auto_speculative="true")  # P without the scheduler, its Ds run it
    assert serve_on_p(s, mgr, p_req("r1", 1024, {"do_remote_decode": True}))[0] == "speculative"
    s, mgr = make_p(link_gbps=0.5, auto_speculative=False)
    s.speculation_enabled = True
    assert serve_on_p(s, mgr, p_req("r1", 1024, {"do_remote_decode": True}))[0] == "full"


def test_p_uses_the_measured_link_and_the_queue_when_no_rate_is_configured():
    s, mgr = make_p()
    assert serve_on_p(s, mgr, p_req("a", 1024, {"do_remote_decode": True}))[0] == "bf16"  # nothing known yet
    s.update_connector_output(SimpleNamespace(finished_recving=(), failed_recving=(),
                                              kv_connector_worker_meta=LynxWorkerMeta(p_link=(0.2e9 / 8, 0, 0.0))))
    s.speculation_enabled = True
    mode, params = serve_on_p(s, mgr, p_req("b", 1024, {"do_remote_decode": True}))
    assert mode == "speculative" and RemotePrefill.from_params(params).auto_reason == "slow_link"
    s.update_connector_output(SimpleNamespace(finished_recving=(), failed_recving=(),
                                              kv_connector_worker_meta=LynxWorkerMeta(p_link=(80e9 / 8, 0, 1e-5))))
    # a fast link, and P's Lynx encodes took 10 us per token (D's decode counted as long): passthrough
    assert serve_on_p(s, mgr, p_req("c", 1024, {"do_remote_decode": True}))[0] == "bf16"


def test_children_of_one_request_share_its_choice():
    s, mgr = make_p(link_gbps=0.5)
    s.speculation_enabled = True
    first = serve_on_p(s, mgr, p_req("0_parent-abcdefgh", 512, {"do_remote_decode": True}))[0]
    s.update_connector_output(SimpleNamespace(finished_recving=(), failed_recving=(),
                                              kv_connector_worker_meta=LynxWorkerMeta(p_link=(80e9 / 8, 0, 1e-5))))
    s._auto.estimator()._configured = None  # the link now looks fast: a new request would get bf16 ...
    assert serve_on_p(s, mgr, p_req("1_parent-abcdefgh", 512, {"do_remote_decode": True}))[0] == first  # ... not a child
    assert serve_on_p(s, mgr, p_req("other", 512, {"do_remote_decode": True}))[0] == "bf16"


def test_logprobs_or_structured_output_keep_a_greedy_request_off_speculation():
    """A greedy request can release its first token on the anchor only without logprobs and without structured
    output (both need the exact logits): on a slow link those get ``full``, a plain greedy one ``speculative``."""
    s, mgr = make_p(link_gbps=0.5)
    s.speculation_enabled = True
    plain = p_req("plain", 1024, {"do_remote_decode": True})
    logprobs = p_req("logprobs", 1024, {"do_remote_decode": True})
    logprobs.sampling_params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    structured = p_req("structured", 1024, {"do_remote_decode": True})
    structured.use_structured_output = True
    assert [serve_on_p(s, mgr, r)[0] for r in (plain, logprobs, structured)] == ["speculative", "full", "full"]
    assert [tuple(x) for x in s.stats.data["auto"]] == [("speculative", "slow_link"),
                                                       ("full", "slow_link_no_speculation"),
                                                       ("full", "slow_link_no_speculation")]


def test_the_choices_remembered_per_parent_are_bounded(monkeypatch):
    """P remembers one choice per parent of fanned-out (n > 1) requests for its later children: at most
    MAX_PARENTS, the oldest forgotten first (a long-running P must not grow without bound)."""
    monkeypatch.setattr(AutoPolicy, "MAX_PARENTS", 2)
    s, mgr = make_p(link_gbps=0.5)
    for parent in ("pa", "pb", "pc"):
        serve_on_p(s, mgr, p_req(f"0_{parent}", 64, {"do_remote_decode": True}))
        assert len(s._auto._by_parent) <= 2
    assert list(s._auto._by_parent) == ["pb", "pc"]
    serve_on_p(s, mgr, p_req("0_pd", 64, {"do_remote_decode": True}))
    assert list(s._auto._by_parent) == ["pc", "pd"]

def test_d_reports_the_choice_in_the_final_output():
    s, _ = make_p()
    params = ParamsSigner(load_side_channel_key(), 60).sign(
        {**RemotePrefill(transfer_id="a" * 32, token="b" * 32, engine_id="engine-p", request_id="p-1",
                         host="10.1.2.3", ports=(5555,), num_tokens=64, mode="bf16",
                         auto_reason="fast_link").to_params()})
    r = SimpleNamespace(request_id="d-1", num_prompt_tokens=64, num_computed_tokens=0, kv_transfer_params=params,
                        status=RequestStatus.RUNNING, output_token_ids=[], num_output_tokens=0,
                        use_structured_output=False, prompt_token_ids=list(range(64)))
    assert s.get_num_new_matched_tokens(r, 0) == (64, True)
    s.update_state_after_alloc(r, FakeBlocks([0, 1]), 64)
    s.update_connector_output(SimpleNamespace(finished_recving={"d-1"}, failed_recving=(),
                                              kv_connector_worker_meta=None))
    r.status = RequestStatus.FINISHED_STOPPED
    assert s.request_finished(r, [0, 1]) == (False, {"lynx_auto": {"mode": "bf16", "reason": "fast_link"}})
    with pytest.raises(Exception, match="lynx_auto"):
        RemotePrefill.from_params({**params, "lynx_auto": "because"})


def test_p_chooses_in_the_concurrent_flow_and_stages_under_the_proxy_ticket():
    """Concurrent flow (issue 15) with auto: P chooses as it schedules the request and stages it under the ticket
    the proxy minted, naming its choice and reason to the worker (which names them to D in Regions, protocol v3)."""
    from lynx_connector.concurrent import mint, prefill_params

    s, mgr = make_p(link_gbps=0.5)
    s.speculation_enabled = True
    tid, token = mint()
    signed = ParamsSigner(load_side_channel_key(), 60).sign(prefill_params(tid, token, "auto"))
    r = p_req("c1", 1024, signed)
    mgr.blocks["c1"] = list(range(-(-1024 // BS)))
    s.update_state_after_alloc(r, FakeBlocks(mgr.blocks["c1"]), 0)
    save = s.build_connector_meta(sched_out(c1=1024)).reqs_to_save[0]
    assert (save.mode, save.auto_reason, save.transfer_id, save.token) == ("speculative", "slow_link", tid, token)
    assert [tuple(x) for x in s.stats.data["auto"]] == [("speculative", "slow_link")]
    # unsigned concurrent params (a client naming its own transfer id) are still refused
    r2 = p_req("c2", 64, {**prefill_params(*mint(), "auto")})
    s.update_state_after_alloc(r2, FakeBlocks([0]), 0)
    r2.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(r2, [])[1]["lynx_error"]["code"] == 400


def test_p_stages_a_proxy_ticket_for_one_request_only():
    """vLLM's n > 1 children copy the request's params: a concurrent-flow ticket is served by the first request
    that presents it, and refused for any other while the first holds it (before, both were staged under it and
    the worker's duplicate raised out of the engine step)."""
    from lynx_connector.concurrent import mint, prefill_params

    s, mgr = make_p()
    signed = ParamsSigner(load_side_channel_key(), 60).sign(prefill_params(*mint(), "full"))
    first, twin = p_req("0_c1", 64, dict(signed)), p_req("1_c1", 64, dict(signed))
    for r in (first, twin):
        mgr.blocks[r.request_id] = [0, 1]
        s.update_state_after_alloc(r, FakeBlocks([0, 1]), 0)
    assert [x.req_id for x in s.build_connector_meta(sched_out(**{"0_c1": 64, "1_c1": 64})).reqs_to_save] == ["0_c1"]
    twin.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, out = s.request_finished(twin, [0, 1])
    assert hold is False and out["lynx_error"]["code"] == 400 and "replayed" in out["lynx_error"]["message"]
    assert s.stats.data["refused_replayed"] == 1


def test_a_preempted_p_request_keeps_its_ticket_and_choice_when_scheduled_again():
    """vLLM calls update_state_after_alloc again for a P request preempted and scheduled anew. Before, its own
    concurrent-flow ticket (held since the first call) made it a "replayed" refusal, logged and counted, and auto
    chose again. Its first choice and ticket stand now; nothing is refused."""
    from lynx_connector.concurrent import mint, prefill_params

    s, mgr = make_p(link_gbps=0.5)
    s.speculation_enabled = True
    tid, token = mint()
    r = p_req("c1", 1024, ParamsSigner(load_side_channel_key(), 60).sign(prefill_params(tid, token, "auto")))
    mgr.blocks["c1"] = list(range(-(-1024 // BS)))
    for _ in range(2):  # scheduled, preempted, scheduled again
        s.update_state_after_alloc(r, FakeBlocks(mgr.blocks["c1"]), 0)
    save = s.build_connector_meta(sched_out(c1=1024)).reqs_to_save
    assert [(x.req_id, x.mode, x.transfer_id, x.token) for x in save] == [("c1", "speculative", tid, token)]
    assert s.stats.data["refused_replayed"] == 0 and [tuple(x) for x in s.stats.data["auto"]] == [
        ("speculative", "slow_link")]
    assert "c1" not in s._refused


def test_a_preempted_refused_p_request_is_refused_once():
    """A P request refused (a mode not allowed) and scheduled again after a preemption was counted and logged
    again each time vLLM called update_state_after_alloc."""
    s, mgr = make_p()
    r = p_req("c2", 256, {"do_remote_decode": True, "lynx_mode": "int4"})
    mgr.blocks["c2"] = list(range(-(-256 // BS)))
    for _ in range(3):
        s.update_state_after_alloc(r, FakeBlocks(mgr.blocks["c2"]), 0)
    assert s.stats.data["refused_mode_not_allowed"] == 1 and "c2" in s._refused


def d_auto_req(req_id="d-1", n=64, structured=False):
    from lynx_connector.concurrent import PrefillEndpoint, decode_params, mint

    params = ParamsSigner(load_side_channel_key(), 60).sign(decode_params(
        PrefillEndpoint("engine-p", "10.1.2.3", (5555,), "float32"), "p-1", *mint(), "auto"))
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=n, num_computed_tokens=0, kv_transfer_params=params,
                           status=RequestStatus.RUNNING, output_token_ids=[], num_output_tokens=0,
                           use_structured_output=structured, prompt_token_ids=list(range(n)),
                           block_hashes=[bytes([i]) * 32 for i in range(n // BS)])


@pytest.mark.parametrize("p_choice, reason, pending", [("bf16", "fast_link", False),
                                                        ("speculative", "slow_link", True),
                                                        ("full", "slow_link_no_speculation", True)])
def test_d_lets_p_choose_in_the_concurrent_flow(p_choice, reason, pending):
    """D of the concurrent flow with auto: the request pulls provisionally as the Lynx mode D serves (speculative
    here), fenced from the prefix cache; once its worker reports the mode P named, a passthrough choice is no
    longer pending a residual, a Lynx one stays speculative (D's pick), and the final output names the mode served,
    P's reason and, where D served another mode than P chose (full served as speculative), P's choice."""
    s, mgr = make_p()
    s.speculation_enabled = True
    r = d_auto_req()
    assert s.get_num_new_matched_tokens(r, 0) == (64, True)
    s.update_state_after_alloc(r, FakeBlocks([0, 1]), 64)
    spec = s.build_connector_meta(sched_out()).reqs_to_recv[0]
    assert (spec.mode, spec.auto, spec.concurrent) == ("speculative", True, True)
    assert "d-1" in s.spec.pending and r.block_hashes[0] != bytes(32)  # fenced: speculative until P names
    served = "speculative" if get_mode(p_choice).two_stream else p_choice
    s.update_connector_output(SimpleNamespace(finished_recving=(), failed_recving=(), kv_connector_worker_meta=
                                              LynxWorkerMeta(auto_modes={"d-1": (served, reason, p_choice)})))
    assert ("d-1" in s.spec.pending) is pending
    s.update_connector_output(SimpleNamespace(finished_recving={"d-1"}, failed_recving=(), kv_connector_worker_meta=
                                              LynxWorkerMeta(residual_merged={"d-1"})))
    r.status = RequestStatus.FINISHED_STOPPED
    report = {"mode": served, "reason": reason, **({"chosen": "full"} if p_choice == "full" else {})}
    assert s.request_finished(r, [0, 1]) == (False, {"lynx_auto": report})
    # a request aborted before its worker's report arrives keeps nothing behind
    r2 = d_auto_req("d-2")
    s.get_num_new_matched_tokens(r2, 0)
    s.update_state_after_alloc(r2, FakeBlocks([2, 3]), 64)
    r2.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r2, [2, 3]) == (True, None)  # its blocks wait for the worker's cancel
    s.update_connector_output(SimpleNamespace(finished_recving={"d-2"}, failed_recving=(), kv_connector_worker_meta=
                                              LynxWorkerMeta(auto_modes={"d-2": (served, reason, p_choice)})))
    assert s._auto_report == {} and s.spec.pending == set()


def test_p_choice_reported_in_the_step_its_load_is_ready_still_counts():
    """P's bf16 choice and the load's "ready" in one worker output: the ready was taken first and the choice
    skipped as for an ended request, so the request stayed pending a residual that a bf16 pull never reports (held
    at the cap until its client left). The choice is taken first now."""
    s, _ = make_p()
    s.speculation_enabled = True
    r = d_auto_req()
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([0, 1]), 64)
    s.build_connector_meta(sched_out())
    assert "d-1" in s.spec.pending
    s.update_connector_output(SimpleNamespace(finished_recving={"d-1"}, failed_recving=(), kv_connector_worker_meta=
                                              LynxWorkerMeta(auto_modes={"d-1": ("bf16", "fast_link", "bf16")})))
    assert "d-1" not in s.spec.pending and s._auto_report["d-1"]["mode"] == "bf16"


def test_d_without_speculation_serves_a_lynx_choice_as_full():
    s, _ = make_p()  # no speculative scheduler on this D
    for req_id, structured in (("d-1", False), ("d-2", True)):
        r = d_auto_req(req_id, structured=structured)
        s.speculation_enabled = structured  # structured output: never speculative either
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, FakeBlocks([0, 1]), 64)
        spec = s.build_connector_meta(sched_out()).reqs_to_recv[0]
        assert (spec.mode, spec.auto) == ("full", True) and req_id not in s.spec.pending
    with pytest.raises(Exception, match="or auto, in the concurrent flow"):
        RemotePrefill.from_params({**d_auto_req().kv_transfer_params, "lynx_mode": "int5"})
    sequential = {k: v for k, v in d_auto_req().kv_transfer_params.items() if k != "lynx_flow"}
    with pytest.raises(Exception, match="lynx_mode 'auto' is not one of"):  # sequential params: P's choice only
        RemotePrefill.from_params({**sequential, "remote_num_tokens": 64})


def test_lynx_proxy_pipelines_auto_requests():
    """The pipelined flow tells D "auto" and lets P name its choice on the side channel (protocol v3): auto (the
    client's, or P's own mode, which the proxy learns from P's signed lynx_auto) is pipelined like a named mode."""
    from lynx_connector.proxy_flow import FlowBook

    p_params = RemotePrefill(transfer_id="a" * 32, token="b" * 32, engine_id="e", request_id="r", host="h",
                             ports=(5600,), num_tokens=16, mode="speculative", auto_reason="slow_link").to_params()
    book = FlowBook(signer=object())
    assert book.plan("p", {}) is None  # nothing learned about this P yet: sequential
    book.learn("p", {}, p_params)  # a request without lynx_mode: P's own mode chose speculative
    assert book.default_mode["p"] == "auto"
    assert book.plan("p", {})[1] == "auto"  # P's default is auto: pipelined as auto
    assert book.plan("p", {"kv_transfer_params": {"lynx_mode": "auto"}})[1] == "auto"
    assert book.plan("p", {"kv_transfer_params": {"lynx_mode": "full"}})[1] == "full"
    book.learn("p", {}, {**p_params, "lynx_auto": None})
    assert book.plan("p", {})[1] == "speculative"
    assert FlowBook(signer=None).plan("p", {}) is None  # no deployment key: sequential only


def test_p_refuses_a_prompt_its_staging_can_never_hold_and_auto_avoids_such_modes(caplog):
    """The workers tell P's scheduler half the longest prompt their staging pool holds per mode (handshake
    metadata, measured at start-up): a longer one is refused before it is staged, with a 400 ``lynx_error`` the
    proxy relays (before, P prefilled it, failed to stage it, and D's pull failed); auto leaves out the modes it
    does not fit, and is refused only when it fits none."""
    s, mgr = make_p(allowed_modes="full,speculative,bf16,auto,int8")  # no link rate known: auto -> bf16
    s.set_handshake({0: LynxHandshakeMetadata(host="10.1.2.3", port=5555, tp_rank=0, kv_dtype="float32",
                                              longest_prompt={"bf16": 1000, "full": 4000, "speculative": 4000,
                                                              "int8": 4000})})
    assert serve_on_p(s, mgr, p_req("short", 900, {"do_remote_decode": True}))[0] == "bf16"
    assert serve_on_p(s, mgr, p_req("long", 2000, {"do_remote_decode": True}))[0] == "full"  # bf16 cannot hold it
    assert serve_on_p(s, mgr, p_req("long8", 2000, {"do_remote_decode": True, "lynx_mode": "int8"}))[0] == "int8"
    failures = s.stats.data["failed_too_large"]
    for req_id, n, params in (("b", 2000, {"do_remote_decode": True, "lynx_mode": "bf16"}),
                              ("huge", 5000, {"do_remote_decode": True})):  # auto: no mode holds it
        r = p_req(req_id, n, params)
        mgr.blocks[req_id] = list(range(-(-n // BS)))
        s.update_state_after_alloc(r, FakeBlocks(mgr.blocks[req_id]), 0)
        assert s.build_connector_meta(sched_out(**{req_id: n})).reqs_to_save == []  # never staged
        r.status, r.output_token_ids, r.num_output_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, [7], 1
        hold, out = s.request_finished(r, [])
        err = out["lynx_error"]
        assert hold is False and err["code"] == 400 and f"({n} tokens)" in err["message"], out
        assert "staging_mb" in err["message"] and "at most" in err["message"]
        assert ("no allowed mode fits" in err["message"]) == (req_id == "huge")
    assert s.stats.data["failed_too_large"] == failures + 2  # vllm:lynx_failed_transfers_total{reason="too_large"}
    # warned through the refusals' rate-limited log: one line for the two (a client may send many)
    assert sum("refused (too_large" in r.getMessage() for r in caplog.records) == 1


def test_p_checks_the_proxy_ticket_expiry_at_arrival_not_after_its_queue(monkeypatch):
    """The proxy signs a concurrent-flow ticket for --params-ttl; a request that waited in P's queue past that
    was refused as expired (a 400 for the client, D's call cancelled) although it came in time: P now checks
    the expiry against the time vLLM added the request (on_new_request). One that came late is refused."""
    import time as _time

    from lynx_connector import prefill_admission as sched_mod
    from lynx_connector.concurrent import mint, prefill_params

    now = _time.time()
    proxy = ParamsSigner(load_side_channel_key(), 60, clock=lambda: now - 100)  # signed 100 s ago: expired 40 s ago
    s, mgr = make_p()
    waited, late = (p_req(rid, 64, proxy.sign(prefill_params(*mint(), "full"))) for rid in ("c1", "c2"))
    monkeypatch.setattr(sched_mod, "time", SimpleNamespace(time=lambda: now - 90))  # c1: 10 s after signing
    s.on_new_request(waited)
    monkeypatch.setattr(sched_mod, "time", SimpleNamespace(time=lambda: now - 30))  # c2: 70 s, 10 s too late
    s.on_new_request(late)
    for r in (waited, late):
        mgr.blocks[r.request_id] = [0, 1]
        s.update_state_after_alloc(r, FakeBlocks([0, 1]), 0)
    assert [x.req_id for x in s.build_connector_meta(sched_out(c1=64, c2=64)).reqs_to_save] == ["c1"]
    late.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, out = s.request_finished(late, [0, 1])
    assert "expired" in out["lynx_error"]["message"] and "--params-ttl" in out["lynx_error"]["message"]
    assert s._arrived == {}
