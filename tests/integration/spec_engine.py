"""A real vLLM engine in a child process that runs probe functions next to the engine (for the speculative
mode tests): ``SpecEngine.call("module:function", *args)`` runs ``function(llm, *args)`` in the child and
returns its (picklable) result. Same engine settings as ``tests.integration.engines.EngineProcess``."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import traceback
from typing import Any

from tests.integration.engines import ENGINE_ENV

SPEC_ENV = {"LYNX_TEST_HOOKS": "1"}


def _child(conn, engine_kwargs: dict[str, Any], env: dict[str, str]) -> None:
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
            target, args = payload
            mod, fn = target.split(":")
            conn.send(("ok", getattr(importlib.import_module(mod), fn)(llm, *args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class SpecEngine:
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
        env = dict(ENGINE_ENV, **SPEC_ENV)
        if cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, kwargs, env), daemon=True)
        self.proc.start()
        if not self.conn.poll(start_timeout):
            self.close()
            raise TimeoutError("engine did not start in time")
        status, info = self.conn.recv()
        if status != "ready":
            self.close()
            raise RuntimeError(f"engine failed to start:\n{info}")

    def call(self, target: str, *args: Any, timeout: float = 300) -> Any:
        self.conn.send(("call", (target, args)))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine did not answer {target} in time")
        status, info = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine error:\n{info}")
        return info

    def generate(self, prompts: list[list[int]], kv_params: list[dict | None] | None = None,
                 timeout: float = 300, **sampling: Any) -> list[dict[str, Any]]:
        sp = {"temperature": 0.0, "max_tokens": 16}
        sp.update(sampling)
        return self.call("tests.integration.spec_probes:generate", prompts, sp, kv_params, timeout=timeout)

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
