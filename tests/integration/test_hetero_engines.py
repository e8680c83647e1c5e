"""Heterogeneous P and D on real vLLM engines (issue 18.4; CPU, the real SmolLM2, real needle prompts, KV over
real NIXL): P at block size 32 (fp32), D at block size 128, where vLLM's NixlConnector needs P's block <= D's
and identical dtypes. Full mode's greedy outputs equal a same-config D's (block size 32) and speculative equals
full on the same D, and the lossless mode equals the same-config D's; a bf16 D (block size 128) behind the fp32 P
and an fp32 D (block size 32) behind a bf16 P (block size 128) pull, answer the needles, speculative == full.
Each D is checked to have pulled every prompt (its worker's counters), so a silent local prefill cannot pass."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.engines import EngineProcess, SpecEngine, lynx_kv_config

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(1500)]

MAX_TOKENS = 12


def pulled(llm: Any) -> dict[str, Any]:
    """Probe run inside D's process: its worker's layout and the pulls it finished (ok / failed) since the first
    call, counted at the worker's single exit of a pull (``_finish_recv``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group().connector_worker
    counts = w.__dict__.get("_test_pull_counts")
    if counts is None:
        counts = w._test_pull_counts = {"ok": 0, "failed": 0}
        real = w._finish_recv

        def finish(rec, error, outcome="failed"):
            counts["ok" if error is None else "failed"] += 1
            return real(rec, error, outcome)

        w._finish_recv = finish
    return {"block_size": w.layout.block_size, "dtype": str(w.layout.dtype), **counts}


@pytest.fixture(scope="module")
def prompts(model):
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_needle_prompt

    tok = AutoTokenizer.from_pretrained(model)
    return [build_needle_prompt(tok, n, depth=d, seed=s) for n, d, s in ((1000, 0.3, 1), (1500, 0.5, 2),
                                                                          (1900, 0.7, 3))]


@pytest.fixture(scope="module")
def prefill(model):
    p = EngineProcess(model, lynx_kv_config("full"), cpu="0")  # block size 32, fp32 (ENGINE_DEFAULTS)
    try:
        yield p
    finally:
        p.close()


def decode_engine(model: str, **overrides: Any) -> SpecEngine:
    from lynx_connector.presets import speculative_engine_args

    # kv_load_failure_policy "fail": a pull that fails ends the request in an error, never a local prefill
    cfg = dict(lynx_kv_config("full"), kv_load_failure_policy="fail")
    return SpecEngine(model, cfg, cpu="1", **speculative_engine_args(8), **overrides)


def run(p, d, prompts, mode: str, p_dtype: str = "float32") -> list[dict[str, Any]]:
    ids = [pr.token_ids for pr in prompts]
    pre = p.generate(ids, [{"do_remote_decode": True, "lynx_mode": mode}] * len(ids), max_tokens=1)
    params = [dict(o["kv_transfer_params"]) for o in pre]
    assert all(pp.get("do_remote_prefill") and pp["lynx_kv_dtype"] == p_dtype for pp in params), params
    before = d.call(f"{__name__}:pulled")
    out = d.generate(ids, params, max_tokens=MAX_TOKENS)
    after = d.call(f"{__name__}:pulled")
    assert after["ok"] - before["ok"] == len(ids) and after["failed"] == 0, (before, after)
    assert all(o["finish_reason"] != "error" for o in out), out
    return out


def tokens(outs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


@pytest.fixture(scope="module")
def same_config(model, prefill, prompts):
    """full and bf16 (lossless) mode on a D configured like P (block size 32, fp32): the reference."""
    d = decode_engine(model)
    try:
        assert d.call(f"{__name__}:pulled")["block_size"] == 32
        return {mode: run(prefill, d, prompts, mode) for mode in ("full", "bf16")}
    finally:
        d.close()


def test_p_block_32_to_d_block_128_equals_the_same_config_run(model, prefill, prompts, same_config,
                                                             record_property):
    from lynx_connector.lab.data import needle_found

    d = decode_engine(model, block_size=128)
    try:
        assert d.call(f"{__name__}:pulled")["block_size"] == 128
        full = run(prefill, d, prompts, "full")
        spec = run(prefill, d, prompts, "speculative")
        lossless = run(prefill, d, prompts, "bf16")
    finally:
        d.close()
    record_property("outputs", json.dumps({"same_config": tokens(same_config["full"]), "full": tokens(full)}))
    assert tokens(full) == tokens(same_config["full"])
    assert tokens(spec) == tokens(full)
    assert tokens(lossless) == tokens(same_config["bf16"])
    for pr, o in zip(prompts, full, strict=True):
        assert needle_found(pr.answer, o["text"]), o["text"]


def test_fp32_p_to_bf16_d_block_128_pulls_and_answers(model, prefill, prompts):
    """D rounds P's fp32 planes once to bf16 on write; its own compute is bf16, so the reference here is its own
    full mode (speculative == full) and the needles answered."""
    from lynx_connector.lab.data import needle_found

    d = decode_engine(model, block_size=128, dtype="bfloat16")
    try:
        info = d.call(f"{__name__}:pulled")
        assert (info["block_size"], info["dtype"]) == (128, "torch.bfloat16")
        full = run(prefill, d, prompts, "full")
        spec = run(prefill, d, prompts, "speculative")
        passthrough = run(prefill, d, prompts, "bf16")  # P's fp32 values on the wire, rounded once by D
    finally:
        d.close()
    assert tokens(spec) == tokens(full)
    for pr, o, b in zip(prompts, full, passthrough, strict=True):
        assert needle_found(pr.answer, o["text"]), o["text"]
        assert needle_found(pr.answer, b["text"]), b["text"]


def test_bf16_p_block_128_to_fp32_d_block_32(model, prompts):
    """The reverse: P's block larger than D's (NixlConnector cannot) and a bf16 P behind an fp32 D, which holds
    P's bf16 planes exactly (widening) and a quantized mode's fp32 reconstruction."""
    from lynx_connector.lab.data import needle_found

    # lease_s: this harness lets D pull only after P's generate of every prompt returned, and a bf16 P without
    # native bf16 (AVX2-only CPUs) took over the default test lease of 60 s for three prompts
    p = EngineProcess(model, lynx_kv_config("full", lease_s=600), cpu="0", block_size=128, dtype="bfloat16")
    try:
        d = decode_engine(model)
        try:
            full = run(p, d, prompts, "full", p_dtype="bfloat16")
            spec = run(p, d, prompts, "speculative", p_dtype="bfloat16")
            lossless = run(p, d, prompts, "bf16", p_dtype="bfloat16")
        finally:
            d.close()
    finally:
        p.close()
    assert tokens(spec) == tokens(full)
    for pr, o, b in zip(prompts, full, lossless, strict=True):
        assert needle_found(pr.answer, o["text"]), o["text"]
        assert needle_found(pr.answer, b["text"]), b["text"]
