"""The bench's deployment: P, D and the proxy started once (``lynx_connector.lab.launch.Deployment``, the one
way to start 1P1D), D with the speculative scheduler when this checkout has it, and D restarted per link rate
(``Deployment.restart_decode``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

from lynx_connector import presets
from lynx_connector.lab.bench.e2e.measure import write
from lynx_connector.lab.bench.e2e.plan import Plan, kv_config
from lynx_connector.lab.launch import Deployment, StartupFailed
from lynx_connector.logger import init_logger

logger = init_logger(__name__)

#: D's verification slots per pass: the speculation cap, so all held tokens are verified in one pass.
SPEC_K = presets.DEFAULT_MAX_SPECULATIVE_TOKENS
#: D's restart (a new link rate) may take this long on a busy machine.
RESTART_TIMEOUT_S = 600.0


def speculative_serve_args() -> tuple[list[str], str]:
    """D's extra ``lynx serve`` arguments for the speculative mode (scheduler + null proposer, ``SPEC_K``
    verification slots), when the checkout has ``lynx_connector.speculative``."""
    try:
        import lynx_connector.speculative.proposer  # noqa: F401
        import lynx_connector.speculative.scheduler  # noqa: F401
    except ImportError as exc:
        return [], f"lynx_connector.speculative is not usable here ({exc})"
    return (presets.speculative_serve_args(SPEC_K),
            f"D runs {presets.SPEC_SCHEDULER} with {SPEC_K} verification slots")


class Started(NamedTuple):
    dep: Deployment
    #: seconds from the first start attempt until every server was healthy
    startup_s: float
    #: why D runs without the speculative scheduler although it was asked for (None: it runs as asked)
    spec_failed: str | None


def make_deployment(model: str, log_dir: Path, gbps: float | None, spec_args: list[str], plan: Plan) -> Deployment:
    """P + D + proxy, D with ``spec_args``; P and D on disjoint cores (the CPU backend's OpenMP binding, and
    every process and thread of each server: ``pin_servers``), as on separate machines: without it both servers
    bind their threads to every core and starve each other's transfer threads, and D's engine loop, stepping
    while a pipelined request waits for its KV, runs on P's core during P's prefill."""
    dep = Deployment(model, log_dir, kv_transfer_config=kv_config(gbps, plan.spec_min_margin, plan.auto_speculative),
                     max_model_len=plan.max_model_len, extra_serve_args=list(plan.serve_args),
                     decode_serve_args=spec_args, proxy_args=["--flow", plan.flows[-1]], pin_servers=True,
                     prefill_env={"VLLM_CPU_OMP_THREADS_BIND": plan.p_cpus} if plan.p_cpus else None,
                     decode_env={"VLLM_CPU_OMP_THREADS_BIND": plan.d_cpus} if plan.d_cpus else None)
    # one proxy per flow in front of the same P and D, so the flows are measured side by side
    dep.flow_urls = {plan.flows[-1]: dep.proxy.url}  # type: ignore[attr-defined]
    for flow in plan.flows[:-1]:
        dep.flow_urls[flow] = dep.add_proxy(f"proxy-{flow}", ["--flow", flow]).url  # type: ignore[attr-defined]
    return dep


def start_deployment(model: str, log_dir: Path, gbps: float | None, spec_args: list[str], plan: Plan) -> Started:
    """Start P + D + proxy (D with ``spec_args``); when D cannot start with them, once more without (noted)."""
    dep = make_deployment(model, log_dir / "rate0", gbps, spec_args, plan)
    spec_failed = None
    write(f"== starting P, D and proxy (link {'unpaced' if gbps is None else f'{gbps:g} Gbit/s'}); "
          "a minute or more on a busy 2-core machine")
    t0 = time.perf_counter()
    try:
        dep.__enter__()
    except StartupFailed as exc:
        if not spec_args or exc.servers != ("decode",):  # P or the proxy failing is not the scheduler's doing
            raise
        tail = dep.decode.log_tail(15)
        logger.warning("D did not start with the speculative scheduler (%s); retrying without it", exc)
        if plan.auto_speculative:  # D without the scheduler: P's auto must not pick speculative
            plan.auto_speculative = False
        dep = make_deployment(model, log_dir / "rate0-nospec", gbps, [], plan)
        spec_failed = f"D failed to start with the speculative scheduler: {tail[-300:]}"
        dep.__enter__()
    startup_s = time.perf_counter() - t0
    write(f"  ready after {startup_s:.0f} s")
    return Started(dep, startup_s, spec_failed)


def restart_decode(dep: Deployment, gbps: float | None, log_path: Path, plan: Plan) -> None:
    """D again on the same port with a new link rate (its other arguments as started; P and the proxy keep
    running)."""
    dep.restart_decode(kv_config(gbps, plan.spec_min_margin, plan.auto_speculative), log_path,
                       timeout=RESTART_TIMEOUT_S)
