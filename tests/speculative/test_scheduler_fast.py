"""The speculative scheduler on a real vLLM ``Scheduler`` with no model (seconds; see ``sched_harness``): the test
plays the worker and the model, so every path is driven to the exact step.

Paths of ``LynxSpecScheduler`` and the real-engine test (tests/integration/test_speculative.py) that covers each
end to end -> the fast test here:

* residual merged before any anchor token (``test_greedy_speculative_equals_full[before-any-token]``)
  -> ``test_merged_before_any_token_decodes_at_full_precision``
* hold on the anchor, rewind, verify in one pass, accepted/rejected (``[after-3-tokens]``,
  ``test_corrupted_residual_is_rejected_and_corrected``) -> ``test_held_tokens_are_verified_after_the_rewind``
* cap, capped steps hidden from the batch, several verify passes (``[after-the-cap]``,
  ``test_acceptance_rate_on_real_prompts``) -> ``test_cap_waits_then_verifies_in_passes_of_k``
* the -1 draft padding of the first decode step is stripped (every scenario) -> ``..._after_the_rewind``
* P's first token released at once and committed (``test_first_token_from_prefill_released_on_the_anchor``)
  -> ``test_first_token_of_p_is_released_on_the_anchor``
* stop conditions only probed while holding, judged on verified tokens (``test_eos_and_max_tokens_during_
  speculation``) -> ``test_eos_while_holding_is_only_probed``, ``test_max_tokens_while_holding``
* confidence gate: low-margin stop, first-token mismatch, logprobs stripped (``test_confidence_gate_holds_tokens_
  up_to_the_first_low_margin``) -> ``test_gate_stops_at_the_first_low_margin``, ``test_first_token_mismatch_waits``
* client logprobs: the first token is held, logprobs come from the verification pass (``test_confidence_gate_with_
  client_logprobs``) -> ``test_client_logprobs_hold_the_first_token``
* abort while holding: blocks kept until the worker confirms (``test_abort_while_speculating_releases_blocks_and_
  staging``) -> ``test_abort_while_holding``
* preemption while speculating: held tokens dropped, pull cancelled, recomputed (``test_preemption_while_
  speculating``) -> ``test_preemption_while_holding``
* residual failure -> kv_load_failure_policy fail / recompute (``test_residual_failure_fails_the_request_without_
  hang``, ``test_recompute_policy_after_residual_failure``) -> ``test_residual_failure_policy_fail``,
  ``test_residual_failure_policy_recompute``
* other modes on a speculative D (``test_other_modes_on_a_speculative_decode_instance``)
  -> ``test_other_modes_are_scheduled_as_by_vllm``; no speculative config -> ``test_without_speculative_config``
"""

from __future__ import annotations

import time

import pytest

from tests.speculative.sched_harness import ANCHOR, EOS, FULL, Driver, make_scheduler

pytestmark = pytest.mark.timeout(120)

K, CAP = 4, 6


@pytest.fixture
def drive(mc):
    def make(**kw):
        kw.setdefault("k", K)
        kw.setdefault("cap", CAP)
        return Driver(make_scheduler(mc, **kw))

    return make


def clean(d: Driver) -> None:
    st = d.state()
    assert st["requests"] == [] and st["spec"] == [] and st["spec_pending"] == []
    assert st["free_blocks"] == d.free_at_start


def hold(d: Driver, rid: str, n: int) -> None:
    """Anchor steps until the request holds ``n`` tokens."""
    for _ in range(n):
        d.step()
    assert len(d.sched._spec[rid].held) == n


def test_merged_before_any_token_decodes_at_full_precision(drive):
    d = drive()
    d.add("r", 40, ANCHOR, FULL, max_tokens=8)
    d.step()
    d.step(finished_recving={"r"}, merged={"r"})  # anchor and residual reported in the same step
    out = d.run_until_done("r")
    assert out.tokens == FULL[:8] and out.finish_reason == "length"
    assert out.speculation["speculated"] == 0 and out.speculation["verify_passes"] == 0
    clean(d)


def test_held_tokens_are_verified_after_the_rewind(drive):
    d = drive()
    d.add("r", 40, ANCHOR, FULL, max_tokens=10)
    d.load("r")
    d.step()
    assert d.last.scheduled_spec_decode_tokens == {}  # vLLM's -1 padding of the first decode step is stripped
    assert d.last.num_scheduled_tokens == {"r": 1}
    d.step()
    d.step()
    assert d.out["r"].tokens == []  # held: nothing reached the client
    req = d.req("r")
    assert list(req.output_token_ids) == ANCHOR[:3] and d.sched._spec["r"].held == ANCHOR[:3]
    d.step(merged={"r"})  # the worker merged the residual after this step's forward (a 4th token held)
    d.step()  # rewind: [last prompt token, 4 held drafts] in one pass on the refined KV
    assert d.last.scheduled_spec_decode_tokens == {"r": ANCHOR[:4]}
    assert d.last.num_scheduled_tokens == {"r": 1 + 4}
    assert d.out["r"].tokens == FULL[:3]  # 2 accepted, the target's token at the first disagreement
    out = d.run_until_done("r")
    assert out.tokens == FULL[:10] and out.finish_reason == "length"
    s = out.speculation
    assert (s["speculated"], s["accepted"], s["rejected"], s["verify_passes"]) == (4, 2, 2, 1)
    clean(d)


def test_speculation_counters_are_not_kept_without_the_stats_log(drive):
    """``--disable-log-stats``: vLLM never asks for the stats, so nothing may be kept for them (each finished
    speculative request added five list entries, kept for the life of the process). The request's own speculation
    summary is still returned."""
    d = drive(report_all=True)
    d.sched.log_stats = False
    recorded = []
    record = d.sched._record
    d.sched._record = lambda st: (recorded.append(st), record(st))
    d.add("r", 40, ANCHOR, FULL, max_tokens=10)
    d.load("r")
    d.step()
    d.step()
    d.step(merged={"r"})
    out = d.run_until_done("r")
    assert len(recorded) == 1 and d.sched._stats.is_empty()
    assert out.speculation is not None and out.speculation["verify_passes"] == 1
    clean(d)


def test_cap_waits_then_verifies_in_passes_of_k(drive):
    d = drive()
    d.add("r", 40, ANCHOR, ANCHOR, max_tokens=12)  # the anchor agrees with full precision: all accepted
    d.load("r")
    hold(d, "r", CAP)
    for _ in range(3):  # at the cap: hidden from the batch, nothing scheduled
        d.step()
        assert d.last.num_scheduled_tokens == {}
    assert d.sched._spec["r"].capped_steps == 3 and d.req("r").num_output_tokens == CAP
    d.step(merged={"r"})
    d.step()
    assert d.last.scheduled_spec_decode_tokens == {"r": ANCHOR[:K]}  # first pass: K drafts
    assert d.out["r"].tokens == ANCHOR[:K + 1]
    d.step()
    assert d.last.scheduled_spec_decode_tokens == {"r": ANCHOR[K + 1:CAP]}  # second pass: the rest
    out = d.run_until_done("r")
    assert out.tokens == ANCHOR[:12]
    s = out.speculation
    assert (s["speculated"], s["accepted"], s["rejected"], s["verify_passes"]) == (CAP, CAP, 0, 2)
    assert s["capped_steps"] == 3 + 1  # and the step whose output carried the merge
    clean(d)


def test_first_token_of_p_is_released_on_the_anchor(drive):
    d = drive()
    d.add("r", 40, ANCHOR, FULL, first_token=ANCHOR[0], max_tokens=10)
    d.load("r")
    d.step()
    assert d.out["r"].tokens == [ANCHOR[0]]  # released at once: it is P's full-precision token
    hold(d, "r", 3)
    assert d.out["r"].tokens == [ANCHOR[0]]
    d.step(merged={"r"})
    d.step()  # recompute the last prompt token and the committed one, then verify the held tokens
    req = d.req("r")
    assert d.last.scheduled_spec_decode_tokens == {"r": ANCHOR[1:5]}
    out = d.run_until_done("r")
    assert out.tokens == FULL[:10]
    s = out.speculation
    assert s["first_token_early"] == 1 and s["speculated"] == 4 and s["accepted"] == 1 and s["rejected"] == 3
    assert req.is_finished()
    clean(d)


def test_eos_while_holding_is_only_probed(drive):
    d = drive()
    anchor = [101, 102, EOS, 104, 105]
    d.add("r", 40, anchor, anchor, max_tokens=10, ignore_eos=False)
    d.load("r")
    hold(d, "r", 3)  # EOS held: the probe fires, the request is not finished and decodes no further
    st = d.sched._spec["r"]
    assert st.would_stop and not d.req("r").is_finished() and d.out["r"].finish_reason is None
    d.step()
    assert d.last.num_scheduled_tokens == {}
    d.step(merged={"r"})
    out = d.run_until_done("r")
    assert out.tokens == anchor[:3] and out.finish_reason == "stop"  # judged on the verified tokens
    assert out.speculation["speculated"] == 3 and out.speculation["accepted"] == 3
    clean(d)


def test_max_tokens_while_holding(drive):
    d = drive()
    d.add("r", 40, ANCHOR, FULL, first_token=ANCHOR[0], max_tokens=5)
    d.load("r")
    for _ in range(6):
        d.step()
    assert d.out["r"].tokens == [ANCHOR[0]] and d.sched._spec["r"].would_stop
    d.step(merged={"r"})
    out = d.run_until_done("r")
    assert out.tokens == FULL[:5] and out.finish_reason == "length"
    assert out.speculation["speculated"] + out.speculation["first_token_early"] == 5
    clean(d)


def test_gate_stops_at_the_first_low_margin(drive):
    d = drive(margin=0.4)
    d.add("r", 40, ANCHOR, ANCHOR, max_tokens=10, margins={3: 0.1})
    req = d.req("r")
    d.load("r")
    assert req.sampling_params.logprobs == 2  # the gate asks vLLM for the top two
    for _ in range(5):
        d.step()
    st = d.sched._spec["r"]
    assert st.held == ANCHOR[:3] and st.stopped == "low_margin"  # position 3 is not held
    assert d.last.num_scheduled_tokens == {}
    d.step(merged={"r"})
    out = d.run_until_done("r")
    assert out.tokens == ANCHOR[:10] and out.logprobs == []  # the client asked for none: stripped
    s = out.speculation
    assert (s["speculated"], s["stopped_low_margin"], s["first_token_mismatch"]) == (3, 1, 0)
    clean(d)


def test_first_token_mismatch_waits(drive):
    d = drive(margin=0.4)
    d.add("r", 40, ANCHOR, FULL, first_token=999, max_tokens=6)
    d.load("r")
    d.step()  # D's first anchor token is not P's: nothing held, nothing released, the request waits
    assert d.out["r"].tokens == [] and d.sched._spec["r"].stopped == "first_token_mismatch"
    d.step()
    assert d.last.num_scheduled_tokens == {}
    d.step(merged={"r"})
    out = d.run_until_done("r")
    assert out.tokens == FULL[:6]
    s = out.speculation
    assert (s["speculated"], s["first_token_early"], s["first_token_mismatch"]) == (0, 0, 1)
    clean(d)


def test_client_logprobs_hold_the_first_token(drive):
    d = drive(margin=0.4)
    d.add("r", 40, ANCHOR, FULL, first_token=ANCHOR[0], logprobs=1, max_tokens=8)
    d.load("r")
    hold(d, "r", 3)
    assert d.out["r"].tokens == []  # with logprobs the first token comes from a full-precision pass too
    d.step(merged={"r"})
    out = d.run_until_done("r")
    assert out.tokens == FULL[:8]
    assert sum(len(lp.logprob_token_ids) for lp in out.logprobs) == len(out.tokens)  # one row per released token
    assert out.speculation["first_token_early"] == 0 and out.speculation["speculated"] == 4
    clean(d)


def test_abort_while_holding(drive):
    from vllm.v1.request import RequestStatus

    d = drive()
    d.add("r", 40, ANCHOR, FULL, first_token=ANCHOR[0], max_tokens=20)
    d.load("r")
    d.step()  # P's first token, released
    hold(d, "r", 4)
    d.sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert d.out["r"].tokens == [ANCHOR[0]]  # only P's token ever reached the client
    d.step()
    assert d.last.kv_connector_metadata.recv_aborted == ["r"]
    assert d.free_blocks() < d.free_at_start  # kept until the worker confirms the pull is cancelled
    d.step(finished_recving={"r"})
    d.step()
    clean(d)


def test_preemption_while_holding(drive):
    d = drive()
    d.add("r", 40, ANCHOR, FULL, first_token=ANCHOR[0], max_tokens=12)
    d.load("r")
    d.step()  # P's first token, released
    hold(d, "r", 4)
    req = d.req("r")
    d.sched.running.remove(req)  # as vLLM preempts when it runs out of blocks
    d.sched._preempt_request(req, time.monotonic())
    assert req.status.name == "PREEMPTED" and list(req.output_token_ids) == [ANCHOR[0]]  # held tokens dropped
    for f in d.fakes.values():
        f.merged = True  # recomputed locally at full precision
    d.step()
    assert d.last.kv_connector_metadata.recv_cancelled == ["r"]  # the pull is dropped in the same step
    assert d.last.num_scheduled_tokens == {"r": 40 + 1}  # prompt + the released token, computed locally
    out = d.run_until_done("r")
    assert out.tokens == [ANCHOR[0], *FULL[1:12]] and out.finish_reason == "length"
    assert out.speculation["preempted"] == 1 and out.speculation["speculated"] == 4
    assert (out.speculation["dropped"], out.speculation["rejected"], out.speculation["accepted"]) == (4, 0, 0)
    clean(d)


def test_preemption_in_verification_counts_the_unverified_as_dropped(drive):
    """Preempted after one verification pass of K drafts (+ the target's token) over 6 held tokens: 5 accepted,
    the sixth was never verified (dropped, not rejected); the output still equals full precision."""
    d = drive()
    d.add("r", 40, ANCHOR, ANCHOR, max_tokens=12)
    d.load("r")
    hold(d, "r", 6)
    d.step(merged={"r"})
    d.step()  # the first verification pass (K drafts)
    req = d.req("r")
    d.sched.running.remove(req)
    d.sched._preempt_request(req, time.monotonic())
    out = d.run_until_done("r")
    assert out.tokens == ANCHOR[:12]
    s = out.speculation
    assert (s["speculated"], s["accepted"], s["rejected"], s["dropped"]) == (6, K + 1, 0, 6 - K - 1)


def test_residual_failure_policy_fail(drive):
    d = drive()
    d.add("r", 40, ANCHOR, FULL, first_token=ANCHOR[0], max_tokens=12)
    d.load("r")
    for _ in range(4):
        d.step()
    d.step(failed={"r"})
    out = d.out["r"]
    assert out.finish_reason == "error" and out.tokens == [ANCHOR[0]]  # no held token reached the client
    d.step()
    clean(d)


def test_residual_failure_policy_recompute(drive):
    d = drive(policy="recompute")
    d.add("r", 40, ANCHOR, FULL, max_tokens=8)
    d.load("r")
    for _ in range(3):
        d.step()
    for f in d.fakes.values():
        f.merged = True  # the prompt is recomputed locally at full precision
    d.step(failed={"r"})
    assert list(d.req("r").output_token_ids) == []  # held tokens dropped
    out = d.run_until_done("r")
    assert out.tokens == FULL[:8] and out.finish_reason == "length"
    clean(d)


@pytest.mark.parametrize("mode", ["anchor", "int8", "full"])
def test_other_modes_are_scheduled_as_by_vllm(drive, mode):
    d = drive()
    d.add("r", 40, ANCHOR, mode=mode, max_tokens=4, first_token=ANCHOR[0])
    d.step()
    assert d.last.kv_connector_metadata.reqs_to_recv[0].mode == mode
    d.step(finished_recving={"r"})
    d.step()
    assert d.out["r"].tokens == [ANCHOR[0]]  # released at once, nothing held
    out = d.run_until_done("r")
    assert out.tokens == ANCHOR[:4] and out.speculation is None
    clean(d)


def test_without_speculative_config(drive):
    d = drive(spec=False)
    assert not d.sched.connector.connector_scheduler.speculation_enabled
    d.add("r", 40, ANCHOR, max_tokens=4)
    d.step()
    assert d.last.kv_connector_metadata.reqs_to_recv[0].mode == "full"  # served as full
    d.step(finished_recving={"r"})
    out = d.run_until_done("r")
    assert out.tokens == ANCHOR[:4] and out.speculation is None
    clean(d)


def test_speculation_summary_only_when_asked_for(drive):
    """The summary reaches a request that asks for it (``lynx_report``); the others get vLLM's null
    kv_transfer_params, and the D-wide ``report_speculation`` returns it to every speculative request."""
    outs = {}
    for name, report, report_all in (("asked", True, False), ("quiet", False, False), ("server", False, True)):
        d = drive(report_all=report_all)
        d.add(name, 40, ANCHOR, FULL, max_tokens=6, report=report)
        d.load(name)
        hold(d, name, 2)
        d.step(merged={name})
        outs[name] = d.run_until_done(name)
        assert outs[name].tokens == FULL[:6]
        clean(d)
    assert outs["asked"].speculation["speculated"] == 3 == outs["server"].speculation["speculated"]
    assert outs["quiet"].kv_transfer_params is None


def test_a_capped_request_keeps_its_place_in_the_running_order(drive):
    """A request hidden while it waits for its residual goes back where it was in ``running``, not to the back:
    vLLM's FCFS policy preempts ``running[-1]``, which must be the newer request, not the older one waiting to
    verify."""
    d = drive(cap=2)
    d.add("a", 40, ANCHOR, FULL, max_tokens=12)
    d.step()
    d.step(finished_recving={"a"})
    d.add("b", 40, ANCHOR, FULL, max_tokens=12, mode="full")
    d.step()
    d.step(finished_recving={"b"})
    for _ in range(3):
        d.step()
    assert d.sched._spec["a"].must_wait(2)  # a is capped, hidden in every step
    assert [r.request_id for r in d.sched.running] == ["a", "b"]
