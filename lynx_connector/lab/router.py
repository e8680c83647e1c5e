"""vllm-router (the vLLM project's Rust router, PyPI ``vllm-router``) as the front end of a lab deployment, and
more prefill servers for one: what the scale-out tests run (tests/integration/test_vllm_router.py).

``vllm-router --vllm-pd-disaggregation --prefill URL --decode URL`` (flags of vllm-router 0.1.17) sends each
request to a prefill server with ``max_tokens=1``, ``stream=false`` and its own ``kv_transfer_params``
(``{"do_remote_decode": true, ...}``, replacing the client's), then the original request with P's
``kv_transfer_params`` to a decode server, and relays D's answer. That is the contract Lynx's P and D speak
(docs/OPERATIONS.md, "Front ends"). A prefill URL may carry a bootstrap port (``--prefill URL 9000``); Lynx
needs none (P names its side channel in ``kv_transfer_params``), so none is given.

Both helpers build :class:`~lynx_connector.lab.launch.Server` objects from the launcher's own builders, so an
added P runs exactly like ``Deployment``'s (same arguments, environment and side-channel key).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lynx_connector.lab.launch import Deployment, Server, free_port, serve_argv, server_env

#: The router's Python entry point (the ``vllm-router`` console script runs the same), run by this interpreter.
ROUTER_MODULE = "vllm_router.launch_router"


def router_installed() -> bool:
    """Whether vllm-router (its Python launcher and the Rust extension it drives) imports here."""
    try:
        import vllm_router.router  # noqa: F401  (the Rust router; the launcher alone falls back to a debug LB)
    except ImportError:
        return False
    return True


def router_args(prefill_urls: Sequence[str], decode_urls: Sequence[str], *, port: int, metrics_port: int,
                host: str = "127.0.0.1", policy: str = "round_robin",
                extra: Sequence[str] = ()) -> list[str]:
    """``vllm-router`` arguments of a PD deployment: ``--vllm-pd-disaggregation``, one ``--prefill`` and one
    ``--decode`` per server, ``policy`` for both pools, its Prometheus endpoint on ``metrics_port`` (the
    router's default, 29000, would collide between routers on one machine) and a 1 s start-up check of the
    workers (default 30 s)."""
    if not prefill_urls or not decode_urls:
        raise ValueError("vllm-router in PD mode needs at least one prefill and one decode URL")
    args = ["--host", host, "--port", str(port), "--vllm-pd-disaggregation", "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", "1"]
    for url in prefill_urls:
        args += ["--prefill", url]
    for url in decode_urls:
        args += ["--decode", url]
    return [*args, *extra]


def router_server(name: str, log_dir: Path, prefill_urls: Sequence[str], decode_urls: Sequence[str], *,
                  policy: str = "round_robin", extra: Sequence[str] = ()) -> Server:
    """A vllm-router on free local ports in front of ``prefill_urls`` and ``decode_urls`` (not started)."""
    port = free_port()
    argv = [sys.executable, "-m", ROUTER_MODULE,
            *router_args(prefill_urls, decode_urls, port=port, metrics_port=free_port(), policy=policy, extra=extra)]
    return Server(name, argv, port, Path(log_dir) / f"{name}.log", env={"RUST_LOG": "info"})


def add_prefill(dep: Deployment, name: str, model: str, kv_transfer_config: str, *,
                max_model_len: int = 4096, extra_serve_args: list[str] | None = None) -> Server:
    """One more prefill server for ``dep`` (local deployments only), started and stopped with it: call before
    ``start()`` / ``with dep``. Same ``lynx serve`` arguments and environment as ``dep.prefill`` (the CPU
    defaults, P's cores) and the deployment's side-channel key. ``dep``'s proxy keeps its own prefill list."""
    if dep.topology is not None or dep.prefill.netns is not None:
        raise ValueError("add_prefill supports local deployments only (not netns)")
    port = free_port()
    server = Server(name, serve_argv(model, port, kv_transfer_config, max_model_len=max_model_len,
                                     extra=extra_serve_args), port, dep.log_dir / f"{name}.log",
                    env={**server_env("prefill"), "LYNX_SIDE_CHANNEL_KEY": dep.side_channel_key})
    dep.servers.insert(dep.servers.index(dep.prefill) + 1, server)
    return server


def wait_healthy(server: Server, timeout: float = 60.0) -> None:
    """Wait until ``server`` (started) answers /health; raise with its log tail if it exits or times out."""
    deadline = time.monotonic() + timeout
    while not server.healthy():
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with code {server.proc.returncode} during start-up; last log "
                               f"lines ({server.log_path}):\n{server.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.name} not healthy after {timeout:.0f} s; log {server.log_path}:\n"
                               f"{server.log_tail()}")
        time.sleep(0.5)
