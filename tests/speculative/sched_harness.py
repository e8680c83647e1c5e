"""A real vLLM ``Scheduler`` (``LynxSpecScheduler`` with the real ``LynxConnector`` scheduler half) and no model:
the test plays the worker. In the style of vLLM's own connector unit tests (tests/v1/kv_connector/unit/utils.py):
a tiny local ``config.json`` (no weights, no tokenizer), a ``KVCacheConfig`` with no tensors, hand-made
``ModelRunnerOutput`` / ``KVConnectorOutput`` each step.

The fake model is two token sequences per request, indexed by output position: ``anchor`` (what D samples while
the request's KV is the anchor) and ``full`` (after the residual is merged). A verification pass is greedy
rejection sampling against ``full``: drafts are accepted while they equal it, then ``full``'s token is emitted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lynx_connector.metadata import LynxWorkerMeta, RemotePrefill
from lynx_connector.signing import ParamsSigner
from lynx_connector.transport.keys import load_side_channel_key

BLOCK = 16
EOS = 2
#: The scripted token streams of the scheduler tests: decoding on the anchor, and full precision, which diverges
#: from the anchor at position 2.
ANCHOR = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]
FULL = [101, 102, 203, 204, 205, 206, 207, 208, 209, 210, 211, 212]


def tiny_model_dir(root: Path) -> str:
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 1000,
        "max_position_embeddings": 4096, "torch_dtype": "float32", "eos_token_id": EOS}))
    return str(root)


def model_config(model_dir: str) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float32",
                       max_model_len=4096, seed=0, max_logprobs=20)


def make_scheduler(mc: Any, *, k: int = 4, cap: int = 6, margin: float = 0.0, policy: str = "fail",
                   num_blocks: int = 200, spec: bool = True, report_all: bool = False) -> Any:
    """A ``LynxSpecScheduler`` on D (``kv_both``) with ``num_speculative_tokens`` k and ``max_speculative_tokens``
    cap. ``spec=False``: no speculative config (the scheduler then serves speculative requests as full).
    ``report_all``: ``report_speculation`` on (every request's summary is returned, asked for or not)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from lynx_connector.presets import NULL_PROPOSER
    from lynx_connector.speculative.scheduler import LynxSpecScheduler

    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096, is_encoder_decoder=False,
                         scheduler_cls=LynxSpecScheduler)
    cc = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    cc.num_gpu_blocks = num_blocks
    kv = KVTransferConfig(kv_connector="LynxConnector", kv_connector_module_path="lynx_connector.connector",
                          kv_role="kv_both", kv_load_failure_policy=policy,
                          kv_connector_extra_config={"max_speculative_tokens": cap, "speculative_min_margin": margin,
                                                     "report_speculation": report_all,
                                                     "allowed_modes": "all"})  # the tests play every mode
    sp = (SpeculativeConfig(method="custom_class", model=NULL_PROPOSER, num_speculative_tokens=k,
                            target_model_config=mc, target_parallel_config=ParallelConfig()) if spec else None)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kv,
                    device_config=DeviceConfig("cpu"), speculative_config=sp)
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16,
                                                        dtype=torch.float32))])
    return LynxSpecScheduler(vllm_config=vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(vc),
                             block_size=BLOCK, log_stats=True)


@dataclass
class Fake:
    """The fake model of one request."""

    anchor: list[int]
    full: list[int]
    #: Top-two margin of the token sampled at each output position on the anchor (default: confident).
    margins: dict[int, float] = field(default_factory=dict)
    merged: bool = False  # the residual has been merged: D samples ``full`` from now on


@dataclass
class Released:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    logprobs: list[Any] = field(default_factory=list)

    @property
    def speculation(self) -> dict[str, int] | None:
        return (self.kv_transfer_params or {}).get("lynx_speculation")


class Driver:
    """Plays engine core + worker around a real scheduler: ``step()`` is one ``schedule`` -> fake runner output ->
    ``update_from_output`` -> (null proposer) ``update_draft_token_ids``."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.fakes: dict[str, Fake] = {}
        self.out: dict[str, Released] = {}
        self.last: Any = None  # the latest SchedulerOutput
        self.free_at_start = self.free_blocks()

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, rid: str, prompt_len: int, anchor: list[int], full: list[int] | None = None, *,
            mode: str = "speculative", first_token: int | None = None, max_tokens: int = 32,
            temperature: float = 0.0, logprobs: int | None = None, ignore_eos: bool = True,
            margins: dict[int, float] | None = None, remote: bool = True, report: bool = True) -> Any:
        """``report``: the request asks for its speculation summary (``lynx_report`` in its kv_transfer_params)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        extra = None
        if remote:
            params = RemotePrefill(transfer_id="a" * 32, token="b" * 32, engine_id="engine-p", request_id="p-" + rid,
                                   host="127.0.0.1", ports=(5555,), num_tokens=prompt_len, mode=mode,
                                   first_token=first_token).to_params()
            # signed as P signs them, with the deployment key of the test (conftest)
            params = ParamsSigner(load_side_channel_key(), 600).sign(params)
            if report:
                params["lynx_report"] = True  # not a signed key: a relay may add it
            extra = {"kv_transfer_params": params}
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=logprobs, ignore_eos=ignore_eos,
                            extra_args=extra)
        sp.update_from_generation_config({}, EOS)
        req = Request(rid, list(range(10, 10 + prompt_len)), sp, None, arrival_time=time.time())
        self.fakes[rid] = Fake(list(anchor), list(full if full is not None else anchor), dict(margins or {}))
        self.out[rid] = Released()
        self.sched.add_request(req)
        return req

    def req(self, rid: str) -> Any:
        return self.sched.requests.get(rid)

    def _sample(self, rid: str, drafts: list[int]) -> list[int]:
        fake = self.fakes[rid]
        req = self.req(rid)
        pos = req.num_output_tokens  # output position of the first token this step samples
        seq = fake.full if fake.merged else fake.anchor

        def at(i: int) -> int:
            return seq[i] if i < len(seq) else 900 + i

        out = []
        for j, d in enumerate(drafts):
            if d != at(pos + j):
                out.append(at(pos + j))
                return out
            out.append(d)
        out.append(at(pos + len(drafts)))
        return out

    def step(self, *, finished_recving: set[str] = frozenset(), failed_recving: set[str] = frozenset(),
             merged: set[str] = frozenset(), failed: set[str] = frozenset(),
             first_tokens: dict[str, int] | None = None) -> Any:
        """One engine step. The KV-connector events are those the worker reports after this step's forward
        (so this step's tokens of a request in ``merged`` were still sampled on the anchor); ``first_tokens``:
        P's first tokens the worker learned from P's side channel in this step (concurrent flow)."""
        from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, LogprobsLists, ModelRunnerOutput

        so = self.sched.schedule()
        self.last = so
        rids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in rids:
            req = self.req(rid)
            drafts = list(so.scheduled_spec_decode_tokens.get(rid, []))
            # a chunk that does not reach the end of the prompt samples nothing (schedule() advanced the count)
            if req.num_computed_tokens < req.num_tokens + len(drafts):
                sampled.append([])
            else:
                sampled.append(self._sample(rid, drafts))
        rows_ids, rows_lp, cu = [], [], []
        for rid, toks in zip(rids, sampled, strict=True):
            cu.append(len(rows_ids))
            fake, pos = self.fakes[rid], self.req(rid).num_output_tokens
            for j, t in enumerate(toks):
                m = 5.0 if fake.merged else fake.margins.get(pos + j, 5.0)
                rows_ids.append([t, t, t + 1])
                rows_lp.append([-0.1, -0.1, -0.1 - m])
        logprobs = None
        if rows_ids:
            logprobs = LogprobsLists(np.array(rows_ids, dtype=np.int64), np.array(rows_lp, dtype=np.float32),
                                     np.zeros(len(rows_ids), dtype=np.int64), cu)
        kvo = None
        if finished_recving or failed_recving or merged or failed or first_tokens:
            meta = (LynxWorkerMeta(residual_merged=set(merged), residual_failed=set(failed),
                                   first_tokens=dict(first_tokens or {}))
                    if merged or failed or first_tokens else None)
            kvo = KVConnectorOutput(finished_recving=set(finished_recving) | set(failed_recving),
                                    failed_recving=set(failed_recving), kv_connector_worker_meta=meta)
        mro = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                sampled_token_ids=sampled, logprobs=logprobs, kv_connector_output=kvo)
        outputs = self.sched.update_from_output(so, mro)
        for r in merged:
            if r in self.fakes:
                self.fakes[r].merged = True
        for eco in outputs.values():
            for o in eco.outputs:
                rel = self.out[o.request_id]
                rel.tokens.extend(o.new_token_ids)
                if o.new_logprobs is not None:
                    rel.logprobs.append(o.new_logprobs)
                if o.finish_reason is not None:
                    rel.finish_reason = str(o.finish_reason)
                    rel.kv_transfer_params = o.kv_transfer_params
        if rids:  # the null proposer proposes nothing (what EngineCore.post_step hands the scheduler)
            self.sched.update_draft_token_ids(DraftTokenIds(rids, [[] for _ in rids]))
        return so

    def load(self, rid: str) -> None:
        """Schedule the request (its pull starts), then the worker reports its anchor in D's blocks."""
        self.step()
        assert self.req(rid).status.name == "WAITING_FOR_REMOTE_KVS"
        self.step(finished_recving={rid})

    def state(self) -> dict[str, Any]:
        half = self.sched.connector.connector_scheduler
        return {"requests": sorted(self.sched.requests), "spec": sorted(self.sched._spec),
                "spec_pending": sorted(half.spec.pending), "free_blocks": self.free_blocks()}

    def run_until_done(self, rid: str, max_steps: int = 200, **events: Any) -> Released:
        for _ in range(max_steps):
            if self.out[rid].finish_reason is not None:
                break
            self.step(**events)
            events = {}
        return self.out[rid]
