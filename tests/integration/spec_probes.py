"""Functions run inside a ``SpecEngine`` child next to the engine (single process: the scheduler and the
connector's worker half are reachable from ``llm``)."""

from __future__ import annotations

import time
from typing import Any


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _live(pool: Any) -> int | None:
    if pool is None:
        return None
    val = getattr(pool, "requests_live", None)
    return val() if callable(val) else val


def _spec_state(sched: Any, prefix: str) -> Any:
    for req_id, st in getattr(sched, "_spec", {}).items():
        if req_id.startswith(prefix):
            return st
    return None


def state(llm: Any) -> dict[str, Any]:
    """Bookkeeping that must be empty when nothing runs: scheduler requests, spec states, pulls, staging."""
    core = _core(llm)
    sched = core.scheduler
    half = sched.connector.connector_scheduler
    worker = core.model_executor.driver_worker.worker.model_runner
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    wconn = get_kv_transfer_group().connector_worker
    pool = wconn.sink.pool if wconn.sink is not None else None
    return {
        "requests": sorted(sched.requests),
        "spec": sorted(getattr(sched, "_spec", {})),
        "spec_pending": sorted(half.spec.pending),
        "worker_recvs": sorted(wconn._recvs),
        "staging_live": _live(pool),
        "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
        "runner_requests": len(getattr(worker, "requests", {})),
    }


def _step_until_held(engine: Any, sched: Any, prefix: str, hold: int, outputs: list[Any], deadline: float) -> int:
    """Step the engine until the request holds ``hold`` anchor tokens (or the deadline); returns how many it holds.
    Bounded by time, not by a step count: steps without a forward (the anchor still in flight) take microseconds,
    so any fixed number of them can end before the anchor lands on a quiet machine."""
    held = 0
    while time.monotonic() < deadline:
        outputs.extend(engine.step())
        st = _spec_state(sched, prefix)
        held = len(st.held) if st is not None else 0
        if held >= hold:
            break
        if st is None:
            time.sleep(0.005)
    return held


def abort_while_speculating(llm: Any, prompt: list[int], params: dict[str, Any], hold: int,
                            max_steps: int = 400) -> dict[str, Any]:
    """Add one request, step until it holds ``hold`` anchor tokens, abort it, then step until idle."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    core = _core(llm)
    sched = core.scheduler
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    engine.add_request("abort-me", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=64, extra_args={"kv_transfer_params": params}))
    outputs: list[Any] = []
    held = _step_until_held(engine, sched, "abort-me", hold, outputs, time.monotonic() + 120)
    released = [list(o.outputs[0].token_ids) for o in outputs if o.outputs]
    engine.abort_request(["abort-me"])
    for _ in range(max_steps):
        engine.step()
        if not any(r.startswith("abort-me") for r in sched.requests) and not engine.has_unfinished_requests():
            break
    out = state(llm)
    out.update(held=held, released=released, free_before=free_before)
    return out


def preempt_while_speculating(llm: Any, prompt: list[int], params: dict[str, Any], hold: int,
                              max_tokens: int) -> dict[str, Any]:
    """Add one request, step until it holds ``hold`` anchor tokens, preempt it exactly as vLLM's scheduler does
    when it runs out of blocks (``running.pop()`` then ``_preempt_request``), then step until it finishes."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sched = _core(llm).scheduler
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    engine.add_request("preempt-me", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                      extra_args={"kv_transfer_params": params}))
    outputs: list[Any] = []
    deadline = time.monotonic() + 120
    held = _step_until_held(engine, sched, "preempt-me", hold, outputs, deadline)
    req = next(r for r in sched.running if r.request_id.startswith("preempt-me"))
    released_before = list(req.output_token_ids[: len(req.output_token_ids) - held])
    sched.running.remove(req)
    sched._preempt_request(req, time.monotonic())
    preempted_status = str(req.status)
    while engine.has_unfinished_requests() and time.monotonic() < deadline + 120:
        outputs.extend(engine.step())
    final = [o for o in outputs if o.finished]
    out = state(llm)
    out.update(held=held, released_before=released_before, preempted_status=preempted_status,
               free_before=free_before,
               token_ids=list(final[-1].outputs[0].token_ids) if final else None,
               finish_reason=final[-1].outputs[0].finish_reason if final else None,
               speculation=(final[-1].kv_transfer_params or {}).get("lynx_speculation") if final else None)
    return out
