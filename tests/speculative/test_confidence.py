"""The confidence gate's bookkeeping with small stand-ins for vLLM's request and outputs (the real path, with
vLLM's sampler computing the logprobs, is tests/integration/test_speculative.py::test_confidence_gate_*)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import LogprobsLists

from lynx_connector.speculative.confidence import GATE_LOGPROBS, ConfidenceGate, token_margin


def _req(req_id: str, finished: bool = False, **sp):
    return SimpleNamespace(request_id=req_id, sampling_params=SamplingParams(**sp), is_finished=lambda: finished)


def test_margin_is_the_lead_of_the_sampled_token_over_the_best_other():
    assert token_margin([7, 7, 3], [-0.1, -0.1, -0.6]) == pytest.approx(0.5)  # greedy: sampled == top-1
    assert token_margin([3, 7, 3], [-0.6, -0.1, -0.6]) == pytest.approx(-0.5)  # sampled is not the argmax
    assert token_margin([7, 7], [-0.1, -0.1]) == math.inf  # nobody else listed


def test_greedy_requests_get_a_copy_asking_for_two_logprobs():
    gate = ConfidenceGate(0.4, max_logprobs=20)
    plain, one, five = _req("a", temperature=0.0), _req("b", temperature=0.0, logprobs=1), \
        _req("c", temperature=0.0, logprobs=5)
    client = [r.sampling_params for r in (plain, one, five)]
    for r in (plain, one, five):
        gate.prepare(r)
    assert plain.sampling_params.logprobs == one.sampling_params.logprobs == GATE_LOGPROBS
    assert five.sampling_params is client[2]  # asked for enough already
    assert client[0].logprobs is None and client[1].logprobs == 1  # the client's objects are untouched
    assert [gate.client_params(r) for r in (plain, one, five)] == client
    gate.prepare(plain)  # idempotent
    assert gate.client_params(plain) is client[0]


@pytest.mark.parametrize("margin, max_logprobs, sp", [
    (0.4, 20, dict(temperature=0.8, seed=1)),  # sampled: verified by the rejection rule, not gated
    (0.0, 20, dict(temperature=0.0)),  # gate off
    (0.4, 1, dict(temperature=0.0)),  # the engine cannot return two logprobs
])
def test_not_gated(margin, max_logprobs, sp):
    gate = ConfidenceGate(margin, max_logprobs=max_logprobs)
    r = _req("a", **sp)
    before = r.sampling_params
    gate.prepare(r)
    assert r.sampling_params is before and not gate.gated("a")


def _step(rows: dict[str, tuple[list[int], list[float]]]):
    ids = list(rows)
    return SimpleNamespace(
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[rows[r][0][0]] for r in ids],
        logprobs=LogprobsLists(np.array([rows[r][0] for r in ids]), np.array([rows[r][1] for r in ids]),
                               np.zeros(len(ids), dtype=np.int64), list(range(len(ids) + 1))))


def test_observe_then_confident_consumes_the_margin():
    gate = ConfidenceGate(0.4, max_logprobs=20)
    sure, unsure = _req("sure", temperature=0.0), _req("unsure", temperature=0.0)
    for r in (sure, unsure):
        gate.prepare(r)
    gate.observe(_step({"sure": ([5, 5, 9], [-0.01, -0.01, -3.0]), "unsure": ([4, 4, 8], [-0.6, -0.6, -0.9]),
                        "x": ([1, 1, 2], [-0.5, -0.5, -0.6])}), ["sure", "unsure", "x"])
    assert gate.confident("sure") and not gate.confident("unsure")
    assert gate.confident("unsure")  # consumed: no margin recorded for this step -> hold
    assert gate.confident("x")  # never gated


def test_strip_removes_only_logprobs_the_client_did_not_ask_for_and_forget_cleans_up():
    gate = ConfidenceGate(0.4, max_logprobs=20)
    plain, one = _req("a", temperature=0.0), _req("b", temperature=0.0, logprobs=1)
    gate.prepare(plain)
    gate.prepare(one)
    outs = [SimpleNamespace(request_id=r, new_logprobs=object()) for r in ("a", "b", "c")]
    gate.strip({0: SimpleNamespace(outputs=outs)})
    assert outs[0].new_logprobs is None and outs[1].new_logprobs is not None and outs[2].new_logprobs is not None
    gate.forget({"b": _req("b", finished=True)})
    assert not gate.gated("a") and not gate.gated("b")


def test_unlimited_max_logprobs_enables_the_gate():
    """vLLM's max_logprobs=-1 means unlimited: the gate can get its two logprobs, so it stays on."""
    gate = ConfidenceGate(0.4, max_logprobs=-1)
    assert gate.enabled and gate.min_margin == 0.4
    r = _req("a", temperature=0.0)
    gate.prepare(r)
    assert gate.gated("a") and r.sampling_params.logprobs == GATE_LOGPROBS


def test_a_request_asking_for_specific_logprob_token_ids_is_not_gated():
    """A request with ``logprob_token_ids`` gets logprobs of those tokens, not the top two: it is not gated (its
    sampling parameters are left alone)."""
    gate = ConfidenceGate(0.4, max_logprobs=20)
    r = _req("a", temperature=0.0, logprob_token_ids=[5, 9])
    before = r.sampling_params
    gate.prepare(r)
    assert r.sampling_params is before and not gate.gated("a")


def test_a_step_with_more_than_one_sampled_token_records_no_margin():
    """Only a step that sampled exactly one token for the request gives the anchor-phase token's margin; a row with
    two sampled tokens (e.g. a verification pass) records none, so it cannot stop the next anchor-phase token."""
    gate = ConfidenceGate(0.4, max_logprobs=20)
    gate.prepare(_req("a", temperature=0.0))
    out = SimpleNamespace(
        req_id_to_index={"a": 0}, sampled_token_ids=[[4, 6]],
        logprobs=LogprobsLists(np.array([[4, 4, 8], [6, 6, 1]]), np.array([[-0.6, -0.6, -0.7], [-0.6, -0.6, -0.7]]),
                               np.zeros(2, dtype=np.int64), [0, 2]))  # a 0.1 margin on both rows
    gate.observe(out, ["a"])
    assert gate.confident("a")


def test_a_margin_equal_to_the_threshold_is_confident():
    """The gate stops at a margin *below* min_margin: exactly min_margin is held."""
    gate = ConfidenceGate(0.5, max_logprobs=20)
    gate.prepare(_req("a", temperature=0.0))
    gate.prepare(_req("b", temperature=0.0))
    gate.observe(_step({"a": ([4, 4, 8], [-0.25, -0.25, -0.75]), "b": ([4, 4, 8], [-0.25, -0.25, -0.625])}),
                 ["a", "b"])
    assert gate.confident("a")  # margin exactly 0.5
    assert not gate.confident("b")  # 0.375
