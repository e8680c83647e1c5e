"""Real vLLM engines in child processes for integration tests: a prefill engine (P), a decode engine (D) and a
plain local engine, each a single-process offline ``LLM`` (engine start in seconds, not a minute) driven over
a pipe. P and D run the real LynxConnector and exchange KV over real NIXL between the two processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def lynx_kv_config(mode: str = "full", **extra: Any) -> dict[str, Any]:
    cfg = {"mode": mode, "staging_mb": 256, "timeout_s": 20, "lease_s": 60}
    cfg.update(extra)
    return {
        "kv_connector": "LynxConnector",
        "kv_connector_module_path": "lynx_connector.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": cfg,
    }


def _engine_main(conn, engine_kwargs: dict[str, Any], env: dict[str, str]) -> None:
    os.environ.update(env)
    try:
        from vllm import LLM, SamplingParams

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
            prompts, sp_kwargs, kv_params = payload
            outs = []
            sps = []
            for i in range(len(prompts)):
                kw = dict(sp_kwargs)
                if kv_params is not None and kv_params[i] is not None:
                    kw["extra_args"] = {"kv_transfer_params": kv_params[i]}
                sps.append(SamplingParams(**kw))
            for out in llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False):
                c = out.outputs[0]
                lps = None
                if c.logprobs is not None:
                    lps = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
                outs.append({"token_ids": list(c.token_ids), "text": c.text, "logprobs": lps,
                             "finish_reason": c.finish_reason, "kv_transfer_params": out.kv_transfer_params,
                             "num_cached_tokens": out.num_cached_tokens})
            conn.send(("ok", outs))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class EngineProcess:
    """One real vLLM engine in a spawned process."""

    def __init__(self, model: str, kv_transfer_config: dict[str, Any] | None = None, *, cpu: str | None = None,
                 start_timeout: float = 300, **overrides: Any):
        kwargs: dict[str, Any] = dict(
            model=model, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
            block_size=32, max_model_len=4096, max_num_batched_tokens=4096, max_num_seqs=8,
            enable_prefix_caching=False, seed=0, gpu_memory_utilization=0.9,
        )
        if kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = kv_transfer_config
        kwargs.update(overrides)
        env = dict(ENGINE_ENV)
        if cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main, args=(child, kwargs, env), daemon=True)
        self.proc.start()
        if not self.conn.poll(start_timeout):
            self.close()
            raise TimeoutError("engine did not start in time")
        status, info = self.conn.recv()
        if status != "ready":
            self.close()
            raise RuntimeError(f"engine failed to start:\n{info}")

    def generate(self, prompts: list[list[int]], kv_params: list[dict | None] | None = None,
                 timeout: float = 300, **sampling: Any) -> list[dict[str, Any]]:
        sp = {"temperature": 0.0, "max_tokens": 16}
        sp.update(sampling)
        self.conn.send(("generate", (prompts, sp, kv_params)))
        if not self.conn.poll(timeout):
            raise TimeoutError("engine did not answer in time")
        status, info = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine error:\n{info}")
        return info

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
