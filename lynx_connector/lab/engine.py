"""A real vLLM engine in a child process, driven over a pipe: the one harness of the accuracy benchmark and
the integration tests (P, D and plain local engines).

Each ``EngineProcess`` is a single-process offline ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine
start in seconds, not a minute; the scheduler and the connector's worker half live in that one process) in a
spawned child. Two commands:

* ``generate(prompts, kv_params, score_from=..., **sampling)``: greedy by default, per-prompt
  ``kv_transfer_params``; per output the token ids, text, finish reason, ``kv_transfer_params`` returned by
  the connector, ``num_cached_tokens``, the sampled tokens' logprobs and the top logprobs of every position
  (when ``logprobs`` is asked for) and, with ``score_from`` and ``prompt_logprobs``, the prompt logprobs of
  the tokens from ``score_from[i]`` on (``scored_logprobs``);
* ``call("module:function", *args)``: runs ``function(llm, *args)`` in the child (probes that step the
  engine or read its bookkeeping) and returns its picklable result.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import secrets
import traceback
from typing import Any

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # the side channel's deployment key: one random key per harness process, shared by every engine it starts
    # (P and D must hold the same; docs/OPERATIONS.md "Security")
    "LYNX_SIDE_CHANNEL_KEY": secrets.token_hex(32),
}

#: The engine settings every harness user starts from (CPU, fp32, eager, the launcher's block size).
ENGINE_DEFAULTS: dict[str, Any] = dict(
    dtype="float32", enforce_eager=True, distributed_executor_backend="uni", block_size=32, max_model_len=4096,
    max_num_batched_tokens=4096, max_num_seqs=8, enable_prefix_caching=False, seed=0, gpu_memory_utilization=0.9,
)


def _generate(llm: Any, prompts: list[list[int]], sp_kwargs: dict[str, Any], kv_params: list[dict | None] | None,
              score_from: list[int] | None) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    sps = []
    for i in range(len(prompts)):
        kw = dict(sp_kwargs)
        if kv_params is not None and kv_params[i] is not None:
            kw["extra_args"] = {"kv_transfer_params": kv_params[i]}
        sps.append(SamplingParams(**kw))
    outs = []
    for i, out in enumerate(llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)):
        c = out.outputs[0]
        lps = top = scored = None
        if c.logprobs is not None:
            lps = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
            top = [{int(t): x.logprob for t, x in lp.items()} for lp in c.logprobs]
        if out.prompt_logprobs is not None and score_from is not None:
            ids, plp = prompts[i], out.prompt_logprobs
            if c.finish_reason == "error":
                raise RuntimeError("the request failed on this engine (KV load failure?)")
            if len(plp) != len(ids):
                raise RuntimeError(f"prompt logprobs for {len(plp)} of {len(ids)} prompt tokens")
            scored = [plp[j][ids[j]].logprob for j in range(score_from[i], len(ids))]
        outs.append({"token_ids": list(c.token_ids), "text": c.text, "logprobs": lps, "top_logprobs": top,
                     "scored_logprobs": scored, "finish_reason": c.finish_reason,
                     "kv_transfer_params": out.kv_transfer_params, "num_cached_tokens": out.num_cached_tokens})
    return outs


def _engine_main(conn: Any, engine_kwargs: dict[str, Any], env: dict[str, str]) -> None:
    os.environ.update(env)
    try:
        from vllm import LLM

        llm = LLM(**engine_kwargs)
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:
            break
        if cmd == "stop":
            break
        try:
            if cmd == "generate":
                conn.send(("ok", _generate(llm, *payload)))
            else:
                target, args = payload
                mod, fn = target.split(":")
                conn.send(("ok", getattr(importlib.import_module(mod), fn)(llm, *args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class EngineProcess:
    """One real vLLM engine (``ENGINE_DEFAULTS`` updated by ``overrides``) in a spawned process. ``cpu``:
    its ``VLLM_CPU_OMP_THREADS_BIND``; ``env``: more environment for the child; ``timeout``: how long
    ``generate``/``call`` wait by default."""

    def __init__(self, model: str, kv_transfer_config: dict[str, Any] | None = None, *, cpu: str | None = None,
                 start_timeout: float = 300, timeout: float = 300, env: dict[str, str] | None = None,
                 **overrides: Any):
        kwargs: dict[str, Any] = dict(ENGINE_DEFAULTS, model=model)
        if kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = kv_transfer_config
        kwargs.update(overrides)
        child_env = dict(ENGINE_ENV, **(env or {}))
        if cpu is not None:
            child_env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main, args=(child, kwargs, child_env), daemon=True)
        self.proc.start()
        if not self.conn.poll(start_timeout):
            self.close()
            raise TimeoutError("engine did not start in time")
        status, info = self.conn.recv()
        if status != "ready":
            self.close()
            raise RuntimeError(f"engine failed to start:\n{info}")

    def _ask(self, cmd: str, payload: Any, timeout: float | None, what: str) -> Any:
        self.conn.send((cmd, payload))
        if not self.conn.poll(self.timeout if timeout is None else timeout):
            raise TimeoutError(f"engine did not answer {what} in time")
        status, info = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine error:\n{info}")
        return info

    def generate(self, prompts: list[list[int]], kv_params: list[dict | None] | None = None, *,
                 score_from: list[int] | None = None, timeout: float | None = None,
                 **sampling: Any) -> list[dict[str, Any]]:
        sp = {"temperature": 0.0, "max_tokens": 16}
        sp.update(sampling)
        return self._ask("generate", (prompts, sp, kv_params, score_from), timeout, "generate")

    def call(self, target: str, *args: Any, timeout: float | None = None) -> Any:
        """``function(llm, *args)`` in the child, for ``target`` = ``"module:function"``."""
        return self._ask("call", (target, args), timeout, target)

    def kill(self) -> None:
        """Simulate a vanished peer: SIGKILL, no clean-up."""
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
