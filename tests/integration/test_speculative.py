"""Speculative mode end to end on real vLLM (CPU, fp32, the real SmolLM2, real needle prompts): P encodes, D
decodes on the anchor, holds the tokens, and verifies them when the residual is merged.

One P and one speculation-enabled D serve every scenario: the transfer mode is chosen per request
(``lynx_mode``), so the reference is ``full`` mode on the very same D (same kernels, same batch shapes for
the prompt). When the residual is merged is fixed per request with the test-only hook
``lynx_test_hooks.delay_residual_steps`` (worker steps after the anchor; needs ``LYNX_TEST_HOOKS=1``,
which ``SpecEngine`` sets). D: ``num_speculative_tokens`` K=8, ``max_speculative_tokens`` 16 (so held
tokens are verified in up to two passes, and a late residual exercises the cap), confidence gate off
(``speculative_min_margin`` 0) so that the scenarios hold a known number of tokens; a second D with the
default gate serves the ``test_confidence_gate_*`` tests.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.engines import EngineProcess, SpecEngine, lynx_kv_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

K, CAP = 8, 16
PROBES = "tests.integration.spec_probes"


@pytest.fixture(scope="module")
def prompts(model):
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_needle_prompt

    tok = AutoTokenizer.from_pretrained(model)
    specs = ((1000, 0.3, 1), (1500, 0.5, 2), (1900, 0.7, 3))
    return [build_needle_prompt(tok, n, depth=d, seed=s) for n, d, s in specs]


def spec_d_config(**extra):
    from lynx_connector.presets import speculative_engine_args

    return dict(speculative_engine_args(K), **extra)


@pytest.fixture(scope="module")
def engines(model):
    started = []
    try:
        p = EngineProcess(model, lynx_kv_config("full"), cpu="0")
        started.append(p)
        d = SpecEngine(model, lynx_kv_config("full", max_speculative_tokens=CAP, speculative_min_margin=0), cpu="1",
                       **spec_d_config())
        started.append(d)
        yield p, d
    finally:
        for e in reversed(started):
            e.close()


def prefill(p, ids, mode, hooks=None, report=True):
    """P's params for D; ``report``: D is asked for the speculation summary (``lynx_report``)."""
    pre = p.generate(ids, [{"do_remote_decode": True, "lynx_mode": mode}] * len(ids), max_tokens=1)
    params = [dict(o["kv_transfer_params"]) for o in pre]
    assert all(pp.get("do_remote_prefill") and pp["lynx_mode"] == mode for pp in params), params
    for pp in params:
        if hooks:
            pp["lynx_test_hooks"] = dict(hooks)
        if report:
            pp["lynx_report"] = True
    return params


def run(p, d, ids, mode, hooks=None, **sampling):
    return d.generate(ids, prefill(p, ids, mode, hooks), **sampling)


def counters(out):
    return (out["kv_transfer_params"] or {}).get("lynx_speculation")


_reference: dict = {}
_spec_runs: dict = {}
LONG = dict(max_tokens=CAP + 6, ignore_eos=True, logprobs=1)


def reference(p, d, ids, key, hooks=None, **sampling):
    """full-mode output on the same D (cached per scenario)."""
    if key not in _reference:
        _reference[key] = run(p, d, ids, "full", hooks, **sampling)
    return _reference[key]


@pytest.mark.parametrize("delay", [0, 3, CAP + 4], ids=["before-any-token", "after-3-tokens", "after-the-cap"])
def test_greedy_speculative_equals_full(engines, prompts, delay, record_property):
    """Residual merged before any token, after a few, and after the cap (16 held, two verify passes of 8).
    ignore_eos keeps decoding past the short answers so the cap is reached; EOS is covered below."""
    p, d = engines
    ids = [pr.token_ids for pr in prompts]
    ref = reference(p, d, ids, "long", **LONG)
    out = _spec_runs[delay] = run(p, d, ids, "speculative", {"delay_residual_steps": delay}, **LONG)
    stats = [counters(o) for o in out]
    record_property("speculation", json.dumps(stats))
    for o, r in zip(out, ref, strict=True):
        assert o["token_ids"] == r["token_ids"]
        assert o["finish_reason"] == r["finish_reason"] == "length"
        assert len(o["logprobs"]) == len(o["token_ids"])
    for s in stats:
        assert s is not None and s["dropped"] == 0 and s["accepted"] + s["rejected"] == s["speculated"] <= CAP
        if delay == 0:
            assert s["speculated"] <= 1  # the residual lands at most one step after the anchor
        elif delay == 3:
            assert s["speculated"] == 3 and s["verify_passes"] == 1
        else:
            assert s["speculated"] == CAP and s["capped_steps"] > 0
            assert s["verify_passes"] >= 1 + (s["accepted"] > K)


@pytest.mark.parametrize("delay", [3, CAP + 4], ids=["after-3-tokens", "after-the-cap"])
@pytest.mark.extended
def test_first_token_from_prefill_released_on_the_anchor(engines, prompts, delay):
    """Greedy without logprobs: D's first token on the anchor equals the token P sampled at full precision, so it
    is released at once and verification starts after it. Outputs still equal full mode's."""
    p, d = engines
    ids = [pr.token_ids for pr in prompts]
    sampling = dict(max_tokens=CAP + 6, ignore_eos=True)
    ref = reference(p, d, ids, "long-nologprobs", **sampling)
    params = prefill(p, ids, "speculative", {"delay_residual_steps": delay})
    assert all(pp["lynx_first_token"] == r["token_ids"][0] for pp, r in zip(params, ref, strict=True))
    out = d.generate(ids, params, **sampling)
    for o, r in zip(out, ref, strict=True):
        assert o["token_ids"] == r["token_ids"]
        c = counters(o)
        assert c["first_token_early"] == 1
        # ``delay`` anchor steps: the first gave the released token, the others held ones (at most the cap)
        assert c["speculated"] == min(delay - 1, CAP) and c["dropped"] == 0 and c["accepted"] + c["rejected"] == c["speculated"]


@pytest.mark.extended
def test_eos_and_max_tokens_during_speculation(engines, prompts):
    """The short needle answers end in EOS while decoding on the anchor; max_tokens=5 is reached there too.
    Stops are judged on verified tokens only: outputs and finish reasons equal full mode's."""
    p, d = engines
    ids = [pr.token_ids for pr in prompts]
    ref = reference(p, d, ids, "eos", max_tokens=32)
    out = run(p, d, ids, "speculative", {"delay_residual_steps": 40}, max_tokens=32)
    for o, r in zip(out, ref, strict=True):
        assert o["token_ids"] == r["token_ids"] and o["finish_reason"] == r["finish_reason"]
    eos_held = [counters(o)["speculated"] for o, r in zip(out, ref, strict=True) if r["finish_reason"] == "stop"]
    assert eos_held and all(0 < n <= CAP for n in eos_held)
    out5 = run(p, d, ids, "speculative", {"delay_residual_steps": 12}, max_tokens=5)
    for o, r in zip(out5, ref, strict=True):  # greedy: full mode with max_tokens=5 is the prefix of 5
        assert len(r["token_ids"]) > 5
        assert o["token_ids"] == r["token_ids"][:5] and o["finish_reason"] == "length"
        c = counters(o)  # P's first token is released at once when D's anchor agrees; the other 4 are held
        assert c["speculated"] + c["first_token_early"] == 5


def test_min_tokens_request_equals_full(engines, prompts):
    """vLLM's min-tokens processor stops masking EOS once a request's output, held tokens included, reaches
    min_tokens, and never tracks it again while it stays in the batch: verified speculatively, a request stopped
    at its natural EOS, before min_tokens (7 tokens where full gave 31). It is served as full now: equal to full
    mode's output with the residual landing while it decodes, and at least min_tokens long."""
    p, d = engines
    ids = [pr.token_ids for pr in prompts]
    natural = reference(p, d, ids, "eos", max_tokens=32)
    pick = [i for i, o in enumerate(natural) if o["finish_reason"] == "stop" and len(o["token_ids"]) + 3 < CAP]
    assert pick, [(len(o["token_ids"]), o["finish_reason"]) for o in natural]  # short answers ending in EOS
    chosen = [ids[i] for i in pick]
    m = min(len(natural[i]["token_ids"]) for i in pick) + 2  # past the shortest answer's EOS, below the cap
    ref = run(p, d, chosen, "full", max_tokens=32, min_tokens=m)
    out = run(p, d, chosen, "speculative", {"delay_residual_steps": m + 1}, max_tokens=32, min_tokens=m)
    for o, r in zip(out, ref, strict=True):
        assert o["token_ids"] == r["token_ids"] and o["finish_reason"] == r["finish_reason"]
        assert len(o["token_ids"]) >= m and counters(o) is None  # served as full: no speculation summary


def _first_divergence(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_corrupted_residual_is_rejected_and_corrected(engines, prompts, record_property):
    """A residual whose bits are flipped on arrival changes the prompt KV. Verification must give exactly what
    full-mode decoding on the same corrupted KV gives, and the verifier must accept precisely the held tokens
    that agree with it: accepted == first divergence between the anchor-only decode (what was held) and the
    corrupted-full decode. Acceptance itself need not drop (the corrupted values stay inside the anchor's
    quantization cells, so they may agree with the anchor for a while); it is recorded next to the sound one."""
    p, d = engines
    ids = [pr.token_ids for pr in prompts]
    # logprobs requested: the first token is held and verified too (P's token comes from the uncorrupted KV,
    # so releasing it would not be "full mode on the same corrupted KV").
    sampling = dict(max_tokens=CAP + 4, ignore_eos=True, logprobs=1)
    bad = {"corrupt_residual": True}
    ref_bad = run(p, d, ids, "full", bad, **sampling)
    ref_ok = reference(p, d, ids, "long", **LONG)
    # the corruption changed the KV: the tokens, or (an anchor good enough keeps them for a while) the logprobs
    # of the same tokens; full-mode decoding of the same KV on this D repeats both exactly
    assert any(a["token_ids"] != b["token_ids"][:len(a["token_ids"])]
               or any(abs(x - y) > 1e-4 for x, y in zip(a["logprobs"], b["logprobs"], strict=False))
               for a, b in zip(ref_bad, ref_ok, strict=True))
    anchor = run(p, d, ids, "anchor", **sampling)  # the tokens the anchor phase holds
    out = run(p, d, ids, "speculative", dict(bad, delay_residual_steps=CAP + 4), **sampling)
    for o, r, a in zip(out, ref_bad, anchor, strict=True):
        assert o["token_ids"] == r["token_ids"]
        c = counters(o)
        assert c["speculated"] == CAP
        assert c["accepted"] == min(CAP, _first_divergence(a["token_ids"], r["token_ids"]))
    acc_bad = sum(counters(o)["accepted"] for o in out) / sum(counters(o)["speculated"] for o in out)
    record_property("acceptance_corrupted", acc_bad)


def test_residual_failure_fails_the_request_without_hang(engines, prompts):
    """kv_load_failure_policy=fail (vLLM's default): a residual that fails after the request started decoding on
    its anchor ends it with an error, nothing unverified reaches the client; the engine is clean afterwards."""
    p, d = engines
    ids = [prompts[0].token_ids]
    t0 = time.monotonic()
    params = prefill(p, ids, "speculative", {"fail_residual": True, "delay_residual_steps": 4})
    out = d.generate(ids, params, max_tokens=16)
    # Only P's full-precision first token may have been released (on the anchor), never a held one.
    assert out[0]["finish_reason"] == "error" and out[0]["token_ids"] in ([], [params[0]["lynx_first_token"]]), out
    assert time.monotonic() - t0 < 60
    st = d.call(f"{PROBES}:state")
    assert st["requests"] == [] and st["spec"] == [] and st["spec_pending"] == [] and st["worker_recvs"] == []


def test_abort_while_speculating_releases_blocks_and_staging(engines, prompts):
    p, d = engines
    params = prefill(p, [prompts[1].token_ids], "speculative", {"delay_residual_steps": 1000})[0]
    res = d.call(f"{PROBES}:abort_while_speculating", prompts[1].token_ids, params, 5)
    assert res["held"] >= 5
    # Nothing unverified reached the client: only P's full-precision first token, released on the anchor.
    assert res["released"] and all(r == [params["lynx_first_token"]] for r in res["released"]), res["released"]
    assert res["requests"] == [] and res["spec"] == [] and res["spec_pending"] == [] and res["worker_recvs"] == []
    assert res["free_blocks"] == res["free_before"]  # blocks were held until the worker confirmed, then freed
    assert res["staging_live"] in (0, None)


def test_summary_reaches_only_requests_that_ask(engines, prompts):
    """Without ``lynx_report`` a speculative request's kv_transfer_params are vLLM's null; with it, the summary."""
    p, d = engines
    ids = [prompts[0].token_ids]
    quiet = d.generate(ids, prefill(p, ids, "speculative", {"delay_residual_steps": 2}, report=False), max_tokens=6)
    asked = run(p, d, ids, "speculative", {"delay_residual_steps": 2}, max_tokens=6)
    assert quiet[0]["token_ids"] == asked[0]["token_ids"]
    assert quiet[0]["kv_transfer_params"] is None
    assert counters(asked[0])["speculated"] >= 1


def test_other_modes_on_a_speculative_decode_instance(engines, prompts):
    p, d = engines
    ids = [prompts[0].token_ids]
    for mode in ("anchor", "int8"):
        out = run(p, d, ids, mode, max_tokens=8)
        assert out[0]["token_ids"] and counters(out[0]) is None


@pytest.mark.extended
def test_acceptance_rate_on_real_prompts(engines, prompts, record_property):
    """Measured, not asserted against the paper's 85%: acceptance of tokens decoded on the anchor (cap 16)."""
    p, d = engines
    ids = [pr.token_ids for pr in prompts]
    out = _spec_runs.get(CAP + 4) or run(p, d, ids, "speculative", {"delay_residual_steps": CAP + 4}, **LONG)
    spec = sum(counters(o)["speculated"] for o in out)
    acc = sum(counters(o)["accepted"] for o in out)
    record_property("acceptance_rate", acc / spec)
    print(f"acceptance on {len(ids)} needle prompts: {acc}/{spec} = {acc / spec:.3f}")
    assert spec == CAP * len(ids)


@pytest.mark.extended
def test_recompute_policy_after_residual_failure(model, engines, prompts):
    """kv_load_failure_policy=recompute: the held tokens are dropped, the prompt is recomputed locally, the output
    is the greedy output of a local prefill (P computing the same prompt itself: same kernels, same shapes)."""
    p, _ = engines
    ids = [prompts[0].token_ids]
    ref = p.generate(ids, None, max_tokens=16, ignore_eos=True)
    d2 = SpecEngine(model, dict(lynx_kv_config("full", max_speculative_tokens=CAP, speculative_min_margin=0),
                                kv_load_failure_policy="recompute"), cpu="1", **spec_d_config())
    try:
        t0 = time.monotonic()
        out = run(p, d2, ids, "speculative", {"fail_residual": True, "delay_residual_steps": 4},
                  max_tokens=16, ignore_eos=True)
        assert time.monotonic() - t0 < 120
        assert out[0]["token_ids"] == ref[0]["token_ids"]
        st = d2.call(f"{PROBES}:state")
        assert st["requests"] == [] and st["spec"] == [] and st["worker_recvs"] == []
    finally:
        d2.close()


def test_preemption_while_speculating(engines, prompts):
    """Preempted while decoding on its anchor (as vLLM's scheduler preempts when it runs out of blocks: the last
    running request is popped and ``_preempt_request`` frees its blocks): the held tokens are dropped, the
    residual pull is cancelled, and the request is recomputed locally at full precision from its prompt plus
    the first token already released; its output is what a local full-precision prefill gives, and nothing
    leaks (blocks, pulls, staging, speculation state)."""
    p, d = engines
    ids = prompts[0].token_ids
    ref = p.generate([ids], None, max_tokens=24, ignore_eos=True)[0]  # a local full-precision prefill
    params = prefill(p, [ids], "speculative", {"delay_residual_steps": 1000})[0]
    res = d.call(f"{PROBES}:preempt_while_speculating", ids, params, 6, 24)
    assert res["held"] >= 6 and "PREEMPTED" in res["preempted_status"]
    assert res["released_before"] == [params["lynx_first_token"]]  # only P's token reached the client
    assert res["token_ids"] == ref["token_ids"] and res["finish_reason"] == "length"
    assert res["speculation"]["preempted"] == 1 and res["speculation"]["speculated"] >= 6
    assert res["requests"] == [] and res["spec"] == [] and res["spec_pending"] == []
    assert res["worker_recvs"] == [] and res["staging_live"] in (0, None)
    assert res["free_blocks"] == res["free_before"]


# ---- confidence gate (the default D configuration) ---------------------------------------------------------

@pytest.fixture(scope="module")
def gated_d(model, engines):
    d = SpecEngine(model, lynx_kv_config("full", max_speculative_tokens=CAP), cpu="1", **spec_d_config())
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def gate_prompts(model, prompts):
    """The needle prompts and three summary prompts (free prose: where this model's margins get small)."""
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_summary_prompt

    tok = AutoTokenizer.from_pretrained(model)
    return [pr.token_ids for pr in prompts] + [build_summary_prompt(tok, 1024, seed=s).token_ids for s in (1, 6, 21)]


def _expected_gate(anchor: dict, gate: float, prefill_token: int | None) -> tuple[int, int, int, int]:
    """(speculated, first_token_early, stopped_low_margin, first_token_mismatch) that the gate must report, from
    an ``anchor``-mode run with logprobs=2: P's token (when it may be released) must equal D's first anchor
    token, then tokens are held up to the first one whose top-two margin is below ``gate``, at most CAP."""
    from lynx_connector.speculative.confidence import token_margin

    tokens = anchor["token_ids"]
    margins = [token_margin([t, *lp], [lp[t], *lp.values()]) for lp, t in zip(anchor["top_logprobs"], tokens,
                                                                               strict=True)]
    start = 0
    if prefill_token is not None:
        if tokens[0] != prefill_token:
            return 0, 0, 0, 1
        start = 1  # released at once, not held
    low = next((i for i in range(start, len(margins)) if margins[i] < gate), None)
    stopped = low is not None and low - start < CAP
    return (low - start if stopped else CAP), start, int(stopped), 0


@pytest.mark.extended
def test_confidence_gate_holds_tokens_up_to_the_first_low_margin(engines, gated_d, gate_prompts, record_property):
    """With the default ``speculative_min_margin``, D holds anchor-phase tokens up to (not including) the first
    one whose top-two logit margin on the anchor is below the threshold, and waits for the residual there; when
    its first token on the anchor is not P's, it holds nothing. The expected count comes from an ``anchor``-mode
    run of the same prompt on the same D (the same decode on the same KV, logprobs=2), one prompt at a time so
    both see the same shapes. Outputs equal full mode's, and the logprobs the gate asked for internally do not
    reach a client that asked for none."""
    from lynx_connector.config import LynxConfig

    gate = LynxConfig().speculative_min_margin
    p, _ = engines
    sampling = dict(max_tokens=CAP + 6, ignore_eos=True)
    stops: list[str | None] = []
    held = accepted = 0
    for ids in gate_prompts:
        ref = run(p, gated_d, [ids], "full", **sampling)[0]
        anchor = run(p, gated_d, [ids], "anchor", logprobs=2, **sampling)[0]
        params = prefill(p, [ids], "speculative", {"delay_residual_steps": CAP + 4})
        out = gated_d.generate([ids], params, **sampling)[0]
        assert out["token_ids"] == ref["token_ids"] and out["logprobs"] is None
        c = counters(out)
        want = _expected_gate(anchor, gate, params[0]["lynx_first_token"])
        assert (c["speculated"], c["first_token_early"], c["stopped_low_margin"], c["first_token_mismatch"]) == want
        assert c["dropped"] == 0 and c["accepted"] + c["rejected"] == c["speculated"]
        stops.append("low_margin" if c["stopped_low_margin"] else "first_token_mismatch"
                     if c["first_token_mismatch"] else None)
        held += c["speculated"]
        accepted += c["accepted"]
    record_property("gated_acceptance", f"{accepted}/{held}")
    record_property("gate_stops", json.dumps(stops))
    # every path is exercised: the summaries reach small margins within the cap, the needles run to the cap,
    # and the third summary's first anchor token is not P's (fixed prompts, fp32: deterministic)
    assert "low_margin" in stops and None in stops and "first_token_mismatch" in stops, stops


@pytest.mark.extended
def test_confidence_gate_with_client_logprobs(engines, gated_d, gate_prompts):
    """A client asking for 1 logprob gets exactly that (the gate asks vLLM for 2), from the verification pass:
    equal to full mode's up to float reordering (verification scores several positions in one pass). With
    logprobs the first token is not released early: it is held and gated like the others."""
    from lynx_connector.config import LynxConfig

    p, _ = engines
    ids = [gate_prompts[1]]
    sampling = dict(max_tokens=CAP + 6, ignore_eos=True, logprobs=1)
    ref = run(p, gated_d, ids, "full", **sampling)[0]
    anchor = run(p, gated_d, ids, "anchor", **dict(sampling, logprobs=2))[0]
    out = run(p, gated_d, ids, "speculative", {"delay_residual_steps": CAP + 4}, **sampling)[0]
    assert out["token_ids"] == ref["token_ids"]
    assert out["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-4)
    assert all(len(top) <= 2 for top in out["top_logprobs"])  # the sampled token and the top-1
    c = counters(out)
    want = _expected_gate(anchor, LynxConfig().speculative_min_margin, None)
    assert (c["speculated"], c["first_token_early"], c["stopped_low_margin"], c["first_token_mismatch"]) == want
    assert c["speculated"] > 0  # held tokens were verified (and their logprobs come from that pass)
