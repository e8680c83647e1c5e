"""Real 1P1D with real vLLM engines (CPU, fp32, the real SmolLM2 model, real essays): P and D are separate
processes running LynxConnector, and the KV crosses between them over real NIXL. Compared with a plain local
engine (no connector) on the same prompts."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.engines import SPEC_ENV, EngineProcess, aligned_prompt, lynx_kv_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(model):
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_needle_prompt

    tok = AutoTokenizer.from_pretrained(model)
    return [build_needle_prompt(tok, n, depth=d, seed=s) for n, d, s in ((900, 0.3, 1), (1800, 0.6, 2))]


@pytest.fixture(scope="module")
def engines(model):
    """P, D and a plain local engine; started together (each start is mostly model loading)."""
    started = []
    try:
        p = EngineProcess(model, lynx_kv_config("full"), cpu="0", env=SPEC_ENV)  # P's test hook kv_range
        started.append(p)
        d = EngineProcess(model, lynx_kv_config("full"), cpu="1")
        started.append(d)
        local = EngineProcess(model, None, cpu="1", enable_prefix_caching=True)
        started.append(local)
        yield p, d, local
    finally:
        for e in reversed(started):
            e.close()


def run_pd(p, d, prompts, mode, **sampling):
    ids = [pr.token_ids for pr in prompts]
    pre = p.generate(ids, [{"do_remote_decode": True, "lynx_mode": mode}] * len(ids), max_tokens=1)
    params = [o["kv_transfer_params"] for o in pre]
    assert all(pp and pp.get("do_remote_prefill") for pp in params), params
    return d.generate(ids, params, max_tokens=MAX_TOKENS, **sampling), params


def test_bf16_passthrough_logprobs_equal_local_run_exactly(engines, prompts):
    """Lossless transfer: D's logprobs equal the local run's bit for bit.

    D recomputes the last prompt token on its own (vLLM's P/D contract), so the local run must compute it
    the same way to be comparable at fp32 precision: with prompts of k*32+1 tokens, the local engine's second
    run of the same prompt hits its prefix cache for the first k*32 tokens and computes the last one alone,
    exactly as D does after loading them.
    """
    p, d, local = engines
    for pr in prompts:  # one request at a time: a batch of two would change the float reduction order
        ids = [aligned_prompt(pr.token_ids)]
        local.generate(ids, max_tokens=1)  # fill the local prefix cache
        ref = local.generate(ids, max_tokens=MAX_TOKENS, logprobs=1)
        assert ref[0]["num_cached_tokens"] == len(ids[0]) - 1
        pre = p.generate(ids, [{"do_remote_decode": True, "lynx_mode": "bf16"}], max_tokens=1)
        params = [pre[0]["kv_transfer_params"]]
        assert params[0]["lynx_mode"] == "bf16"
        out = d.generate(ids, params, max_tokens=MAX_TOKENS, logprobs=1)
        assert out[0]["token_ids"] == ref[0]["token_ids"]
        assert out[0]["logprobs"] == ref[0]["logprobs"]  # exact: lossless transfer of an fp32 cache


def test_full_mode_answers_needles_like_the_local_run(engines, prompts, record_property):
    from lynx_connector.lab.data import needle_found

    p, d, local = engines
    ref = local.generate([pr.token_ids for pr in prompts], max_tokens=MAX_TOKENS)
    out, _ = run_pd(p, d, prompts, "full")
    agree = []
    for pr, o, r in zip(prompts, out, ref, strict=True):
        assert needle_found(pr.answer, r["text"]), r["text"]  # the model itself finds the needle
        assert needle_found(pr.answer, o["text"]), o["text"]
        same = 0
        for a, b in zip(o["token_ids"], r["token_ids"], strict=False):
            if a != b:
                break
            same += 1
        agree.append(same / len(r["token_ids"]))
    record_property("greedy_prefix_agreement_full_vs_local", json.dumps(agree))
    # full precision is ~INT8 quality: the answer tokens must be identical, not merely the number found
    assert min(agree) >= 0.5, agree


def test_anchor_only_transfer_is_lossy_but_used(engines, prompts):
    p, d, local = engines
    ref = local.generate([pr.token_ids for pr in prompts], max_tokens=MAX_TOKENS, logprobs=1)
    out, _ = run_pd(p, d, prompts, "anchor", logprobs=1)
    # the KV really came from the anchor planes: logprobs differ from the full-precision run
    assert any(o["logprobs"] != r["logprobs"] for o, r in zip(out, ref, strict=True))


def test_single_stream_baselines_round_trip(engines, prompts):
    from lynx_connector.lab.data import needle_found

    p, d, _ = engines
    for mode in ("int8", "fp8"):
        out, _ = run_pd(p, d, prompts[:1], mode)
        assert needle_found(prompts[0].answer, out[0]["text"]), (mode, out[0]["text"])


def test_corrupted_residual_changes_the_output(model, engines, prompts):
    """Proves D uses the residual it received: flipping its bits on arrival changes the logprobs."""
    p, d, _ = engines
    ok, _ = run_pd(p, d, prompts[:1], "full", logprobs=1)
    bad_d = EngineProcess(model, lynx_kv_config("full", fault_injection="corrupt_residual"), cpu="1")
    try:
        bad, _ = run_pd(p, bad_d, prompts[:1], "full", logprobs=1)
    finally:
        bad_d.close()
    assert bad[0]["logprobs"] != ok[0]["logprobs"]


def test_kv_beyond_the_codecs_range_fails_that_request_only(engines, prompts):
    """|x| > 65504 in P's KV of one request (test hook kv_range: 7e4 written into its first K of layer 0 in P's
    real cache, right before the encode): the real codec raises KVRangeError inside P's save; P rejects only that
    request, D hears P's reason ('range_kv') at its first query and fails it by the policy ('fail') at once, not
    after timeout_s (20 s); the request prefilled in the same batch is answered, and P and D keep serving. P's
    prefix caching is off (EngineProcess), so the altered blocks serve nobody else."""
    from lynx_connector.lab.data import needle_found

    p, d, _ = engines
    bad, good = prompts[0].token_ids[:-40] + prompts[0].token_ids[-1:], prompts[1].token_ids  # bad: its own prompt
    pre = p.generate([bad, good], [{"do_remote_decode": True, "lynx_test_hooks": {"kv_range": True}},
                                   {"do_remote_decode": True}], max_tokens=1)
    params = [o["kv_transfer_params"] for o in pre]
    assert all(pp and pp.get("do_remote_prefill") for pp in params), params
    t0 = time.monotonic()
    out = d.generate([bad, good], params, max_tokens=MAX_TOKENS, timeout=120)
    assert time.monotonic() - t0 < 10, "D heard P's reason at once, not at its 20 s timeout"
    assert out[0]["finish_reason"] == "error" and out[0]["token_ids"] == [], out[0]
    assert needle_found(prompts[1].answer, out[1]["text"]), out[1]["text"]
    again, _ = run_pd(p, d, prompts[1:], "full")  # both engines still serve
    assert needle_found(prompts[1].answer, again[0]["text"]), again[0]["text"]


def test_prefill_with_other_rope_is_refused_at_the_handshake(model, engines, prompts):
    """A P started with ``--hf-overrides`` that change RoPE rotates K by other angles than D would: D's handshake
    is refused on the compat field ``rope`` and the request fails at once with an error, instead of decoding on
    K that D's queries do not match; D goes on serving its own P."""
    from lynx_connector.lab.data import needle_found

    p, d, _ = engines
    other = EngineProcess(model, lynx_kv_config("full"), cpu="0",
                          hf_overrides={"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}})
    try:
        pre = other.generate([prompts[0].token_ids], [{"do_remote_decode": True}], max_tokens=1)
        t0 = time.monotonic()
        out = d.generate([prompts[0].token_ids], [pre[0]["kv_transfer_params"]], max_tokens=MAX_TOKENS, timeout=120)
        assert out[0]["finish_reason"] == "error" and out[0]["token_ids"] == [], out
        assert time.monotonic() - t0 < 20, "refused at the handshake, before D's 20 s timeout_s"
    finally:
        other.close()
    again, _ = run_pd(p, d, prompts[1:], "full")
    assert needle_found(prompts[1].answer, again[0]["text"]), again[0]["text"]


def test_a_decode_instance_midway_through_a_key_rotation_serves_the_old_key_prefill(model, engines, prompts):
    """Key rotation (docs/OPERATIONS.md, "Rotating the deployment key"), the state in the middle of its second
    step: D already has the new deployment key and keeps the old one as its extra key
    (``LYNX_SIDE_CHANNEL_EXTRA_KEY``); P still has only the old one. D verifies P's params (signed with the old key),
    P proves the old key in the handshake, D answers in it, and the request is served from P's KV."""
    import secrets

    from lynx_connector.lab.data import needle_found
    from lynx_connector.lab.engine import ENGINE_ENV

    p, _, _ = engines
    old_key = ENGINE_ENV["LYNX_SIDE_CHANNEL_KEY"]
    d = EngineProcess(model, lynx_kv_config("full"), cpu="1",
                      env={"LYNX_SIDE_CHANNEL_KEY": secrets.token_hex(32), "LYNX_SIDE_CHANNEL_EXTRA_KEY": old_key})
    try:
        out, _ = run_pd(p, d, prompts[:1], "full")
        assert out[0]["finish_reason"] != "error", out[0]
        assert needle_found(prompts[0].answer, out[0]["text"]), out[0]["text"]
        assert not (out[0]["kv_transfer_params"] or {}).get("lynx_error"), out[0]  # params verified: P's KV used
    finally:
        d.close()


def test_a_prompt_p_can_never_stage_is_refused_before_staging(model, engines, prompts):
    """A P whose staging pool (16 MB here) cannot hold the prompt in the mode asked for (the fp32 passthrough:
    about 46 KB a token, ~350 tokens fit) answers with a 400 ``lynx_error`` instead of remote-prefill params, without
    staging it (its workers told its scheduler half the longest prompt per mode at start-up; it still computes the
    prompt: vLLM scheduled it); lynx full, which fits, is served to D as usual."""
    from lynx_connector.lab.data import needle_found

    _, d, _ = engines
    small = EngineProcess(model, lynx_kv_config("full", staging_mb=16), cpu="0")
    try:
        ids = [prompts[0].token_ids]
        bad = small.generate(ids, [{"do_remote_decode": True, "lynx_mode": "bf16"}], max_tokens=1)[0]
        err = (bad["kv_transfer_params"] or {}).get("lynx_error")
        assert err and err["code"] == 400 and "staging_mb=16" in err["message"], bad["kv_transfer_params"]
        assert not bad["kv_transfer_params"].get("do_remote_prefill")
        out, _ = run_pd(small, d, prompts[:1], "full")
        assert needle_found(prompts[0].answer, out[0]["text"]), out[0]["text"]
    finally:
        small.close()


@pytest.mark.parametrize("policy", ["fail", pytest.param("recompute", marks=pytest.mark.extended)])
def test_vanished_prefill_ends_in_the_failure_policy(model, prompts, policy):
    from lynx_connector.lab.data import needle_found

    cfg = lynx_kv_config("full", timeout_s=5)
    p = EngineProcess(model, lynx_kv_config("full"), cpu="0")
    d = EngineProcess(model, dict(cfg, kv_load_failure_policy=policy), cpu="1")
    try:
        pre = p.generate([prompts[0].token_ids], [{"do_remote_decode": True}], max_tokens=1)
        params = [pre[0]["kv_transfer_params"]]
        p.kill()  # P vanishes before D pulls
        t0 = time.monotonic()
        if policy == "fail":
            out = d.generate([prompts[0].token_ids], params, max_tokens=MAX_TOKENS, timeout=120)
            assert out[0]["finish_reason"] == "error" and out[0]["token_ids"] == [], out
        else:
            out = d.generate([prompts[0].token_ids], params, max_tokens=MAX_TOKENS, timeout=120)
            assert needle_found(prompts[0].answer, out[0]["text"]), out[0]["text"]
        assert time.monotonic() - t0 < 60  # bounded by timeout_s, never a hang
    finally:
        d.close()
        p.close()

