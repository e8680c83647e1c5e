"""Start and stop a 1P1D deployment on one machine: a prefill server, a decode server (``lynx serve``, i.e.
``vllm serve`` with the plugin) and the proxy, each in its own process group, logs in a folder.

Used by the demo, the end-to-end benchmark and the server tests. Teardown is guaranteed: ``Deployment`` is a
context manager, registers an atexit hook and turns SIGTERM into a normal exit, so no server outlives it,
also on Ctrl-C or failure.

``Deployment(..., netns=True)`` (root, iproute2) runs P, D and the proxy as separate "hosts": each in its own
network namespace (``lynx_connector.lab.netns``), joined by veth links proxy-P, proxy-D and P-D. KV goes over the
P-D link with UCX forced onto TCP (``UCX_TLS=tcp``, ``UCX_NET_DEVICES`` = that veth) and P's side channel bound
to (and advertised as) its P-D address; ``link_mbit`` shapes that link with tc tbf. The proxy is reachable
only from inside its namespace: make requests within ``with dep.client():`` (the calling thread enters it).
The namespaces are deleted by ``stop()``.

    python -m lynx_connector.lab.launch MODEL [--netns] [--link-mbit 1000] [--kv-transfer-config lynx:speculative]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lynx_connector.logger import init_logger
from lynx_connector.memory import SERVERS_ENV
from lynx_connector.presets import expand_kv_transfer_config

logger = init_logger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    host: str = "127.0.0.1"
    #: network namespace the server runs in (None: this one)
    netns: str | None = None
    #: the cores the whole server (every process and thread it starts) may run on; None = any. The e2e bench
    #: pins P and D to the cores of their compute threads, as on separate machines: else D's engine loop,
    #: stepping while it waits for KV, takes P's core during P's prefill (the pipelined flow's D waits then).
    cpus: set[int] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        env = dict(os.environ)
        env.update(self.env)
        argv = self.argv if self.netns is None else ["ip", "netns", "exec", self.netns, *self.argv]
        self._log = open(self.log_path, "ab")
        # A process group of its own: teardown signals the server and every child it spawned.
        # (`ip netns exec` execs the command: the pid is the server's.)
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        if self.cpus:  # before vLLM spawns its engine and workers (seconds later): they inherit it
            try:
                os.sched_setaffinity(self.proc.pid, self.cpus)
            except OSError as exc:
                logger.warning("cannot pin %s to cores %s: %s", self.name, sorted(self.cpus), exc)
        logger.info("started %s (pid %s%s): %s", self.name, self.proc.pid,
                    f", cores {sorted(self.cpus)}" if self.cpus else "", " ".join(argv))

    def reach(self) -> contextlib.AbstractContextManager[None]:
        """Context in which this server's URL is reachable from the calling thread."""
        if self.netns is None:
            return contextlib.nullcontext()
        from lynx_connector.lab import netns

        return netns.entered(self.netns)

    def healthy(self) -> bool:
        try:
            with self.reach():
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
            return True
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> None:
        stop_servers([self], grace)

    def _signal_group(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def stop_servers(servers: list[Server], grace: float = 15.0, hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM every server's process group at once, wait for them against one deadline of ``grace`` seconds
    (cut short when ``hurry()``: a second Ctrl-C), then SIGKILL the groups (children may outlive a leader).
    A server's ``proc`` is cleared only once its group was killed: a stop interrupted midway is finished by the
    next one (atexit)."""
    live = [s for s in servers if s.proc is not None]
    for s in live:
        if s.proc is not None and s.proc.poll() is None:
            s._signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (time.monotonic() < deadline and not hurry()
           and any(s.proc is not None and s.proc.poll() is None for s in live)):
        time.sleep(0.1)
    for s in live:
        s._signal_group(signal.SIGKILL)
    for s in live:
        proc, s.proc = s.proc, None
        if proc is None:
            continue
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %s) did not exit after SIGKILL", s.name, proc.pid)
        s._log.close()


def serve_args(model: str, port: int, kv_transfer_config: str, *, max_model_len: int = 4096,
               extra: list[str] | None = None, host: str = "127.0.0.1") -> list[str]:
    """The ``lynx serve`` arguments of a P or D server (after ``lynx``): the CPU defaults (fp32, eager, block
    size 32, no prefix caching), then ``extra`` (later values override them, e.g. ``--dtype bfloat16`` on a
    GPU). The one builder: ``Deployment`` and examples/1p1d/run_1p1d.sh (``--shell``) both use it."""
    return ["serve", model, "--host", host, "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len), "--block-size", "32",
            "--max-num-seqs", "8", "--max-num-batched-tokens", str(max_model_len), "--seed", "0",
            "--no-enable-prefix-caching", "--kv-transfer-config", kv_transfer_config, *(extra or [])]


def serve_argv(model: str, port: int, kv_transfer_config: str, *, max_model_len: int = 4096,
               extra: list[str] | None = None, host: str = "127.0.0.1") -> list[str]:
    """:func:`serve_args` run by this interpreter (``python -m lynx_connector.cli``)."""
    return [sys.executable, "-m", "lynx_connector.cli",
            *serve_args(model, port, kv_transfer_config, max_model_len=max_model_len, extra=extra, host=host)]


#: P and D of a launched deployment share this machine (and its GPU): ``lynx serve`` sizes their memory for two
#: (lynx_connector/memory.py: on the CPU backend the KV cache, on a GPU ``--gpu-memory-utilization``).
SERVER_ENV = {"HF_HUB_OFFLINE": "1", SERVERS_ENV: "2", "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}


def cpu_binding(role: str) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for P (first half of the cores) or D (second half), unless the caller set
    it: vLLM binds every CPU worker's compute threads to core 0 by default; P and D get cores of their own,
    as they would have separate machines (or GPUs) in production."""
    n = os.cpu_count() or 1
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or n < 2:
        return {}
    if role == "prefill":
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{n // 2 - 1}" if n >= 4 else "0"}
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{n // 2}-{n - 1}" if n >= 4 else "1"}


def cpu_set(binding: str | None) -> set[int] | None:
    """The cores of a ``VLLM_CPU_OMP_THREADS_BIND`` value such as ``0``, ``2-3`` or ``0,2`` (None: not such a
    list, e.g. ``auto`` or several workers' ``0-1|2-3``)."""
    if not binding:
        return None
    out: set[int] = set()
    try:
        for part in binding.split(","):
            lo, _, hi = part.strip().partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return None
    return out or None


def server_env(role: str, cpus: str | None = None) -> dict[str, str]:
    """Environment of a P (``prefill``) or D (``decode``) server: ``SERVER_ENV`` and its cores
    (``cpus`` when given, else :func:`cpu_binding`)."""
    return {**SERVER_ENV, **({"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus else cpu_binding(role))}


#: Fixed ports in netns mode (each server has its namespace to itself).
NETNS_PORTS = {"prefill": 8100, "decode": 8200, "proxy": 8000}


def with_side_channel_host(kv_transfer_config: str, host: str) -> str:
    """The KVTransferConfig JSON (a preset expanded) with ``kv_connector_extra_config.side_channel_host``."""
    text = expand_kv_transfer_config(kv_transfer_config) or kv_transfer_config
    cfg = json.loads(text)
    cfg.setdefault("kv_connector_extra_config", {})["side_channel_host"] = host
    return json.dumps(cfg)


@dataclass(frozen=True)
class NetnsPlan:
    """Roles, links and addresses of the netns deployment, known before anything is created
    (links in creation order: proxy-P, proxy-D, P-D; see ``Topology.link_addrs``)."""

    link_mbit: float | None = None
    mtu: int = 9000

    @staticmethod
    def links() -> list[tuple[str, str]]:
        return [("x", "p"), ("x", "d"), ("p", "d")]

    @staticmethod
    def addr(role: str, peer: str) -> str:
        from lynx_connector.lab.netns import Topology

        for k, (a, b) in enumerate(NetnsPlan.links(), start=1):
            if (a, b) == (role, peer):
                return Topology.link_addrs(k)[0]
            if (b, a) == (role, peer):
                return Topology.link_addrs(k)[1]
        raise KeyError((role, peer))

    @staticmethod
    def dev(role: str, peer: str) -> str:
        return f"to-{peer}"

    def build(self) -> Any:
        """Create the namespaces and links; returns (topology, {role: namespace})."""
        from lynx_connector.lab import netns

        topo = netns.Topology()
        try:
            names = {role: topo.add_namespace(role) for role in ("x", "p", "d")}
            for a, b in self.links():
                link = topo.add_link(names[a], names[b], mtu=self.mtu)
                assert link.addr_a == self.addr(a, b) and link.dev_a == self.dev(a, b), link
            if self.link_mbit is not None:
                topo.shape(names["p"], self.dev("p", "d"), self.link_mbit)
                topo.shape(names["d"], self.dev("d", "p"), self.link_mbit)
        except BaseException:
            topo.destroy()
            raise
        return topo, names


class Deployment:
    """P + D + proxy. ``kv_transfer_config`` is what both servers get (the preset ``lynx`` by default)."""

    def __init__(self, model: str, log_dir: Path, *, kv_transfer_config: str = "lynx",
                 max_model_len: int = 4096, startup_timeout: float = 420.0, extra_serve_args: list[str] | None = None,
                 netns: bool = False, link_mbit: float | None = None, decode_serve_args: list[str] | None = None,
                 prefill_env: dict[str, str] | None = None, decode_env: dict[str, str] | None = None,
                 proxy_args: list[str] | None = None, pin_servers: bool = False):
        """``extra_serve_args`` go to P and D, ``decode_serve_args`` to D only (after them); ``prefill_env`` and
        ``decode_env`` override the servers' environment (e.g. ``VLLM_CPU_OMP_THREADS_BIND``); ``proxy_args``
        go to ``lynx proxy`` (e.g. ``--max-inflight 4``); ``pin_servers`` runs P and D wholly on the cores of
        their compute threads (``VLLM_CPU_OMP_THREADS_BIND``), as on separate machines."""
        self._proxy_args = list(proxy_args or [])
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout = startup_timeout
        self.topology: Any = None
        self._old_handlers: dict[int, Any] = {}  # the signal handlers __enter__ replaced
        self._model, self._max_model_len = model, max_model_len
        self._extra = {"prefill": list(extra_serve_args or []),
                       "decode": list(extra_serve_args or []) + list(decode_serve_args or [])}
        #: seconds the last ``start()`` took until every server was healthy (None before)
        self.startup_s: float | None = None
        self._plan = NetnsPlan(link_mbit=link_mbit) if netns else None
        if link_mbit is not None and not netns:
            raise ValueError("link_mbit shapes the P-D veth: it needs netns=True (else use link_gbps pacing)")
        if self._plan is not None:
            self._init_netns(kv_transfer_config)
        else:
            self._init_local(kv_transfer_config)
        #: this deployment's side-channel key (hex), in P's and D's environment (callers' envs may override it)
        self.side_channel_key = secrets.token_hex(32)
        for server in (self.prefill, self.decode, self.proxy):  # the proxy signs the pipelined flow's params
            server.env["LYNX_SIDE_CHANNEL_KEY"] = self.side_channel_key
        self.prefill.env.update(prefill_env or {})
        self.decode.env.update(decode_env or {})
        if pin_servers:  # each server on the cores of its compute threads only (the e2e bench)
            for server in (self.prefill, self.decode):
                server.cpus = cpu_set(server.env.get("VLLM_CPU_OMP_THREADS_BIND"))

    def _init_local(self, kv_cfg: str) -> None:
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        env = dict(SERVER_ENV)
        self.prefill = Server("prefill", self._serve_argv("prefill", p_port, kv_cfg), p_port,
                              self.log_dir / "prefill.log", env=server_env("prefill"))
        self.decode = Server("decode", self._serve_argv("decode", d_port, kv_cfg), d_port,
                             self.log_dir / "decode.log", env=server_env("decode"))
        self.proxy = Server("proxy", [sys.executable, "-m", "lynx_connector.cli", "proxy", "--host", "127.0.0.1",
                                      "--port", str(x_port), "--prefill", self.prefill.url,
                                      "--decode", self.decode.url, *self._proxy_args],
                            x_port, self.log_dir / "proxy.log", env=dict(env))
        self.servers = [self.prefill, self.decode, self.proxy]

    def _serve_argv(self, name: str, port: int, kv_cfg: str) -> list[str]:
        """``lynx serve`` argv of P or D: local, or in netns mode bound to its proxy-side address with the side
        channel on its P-D address."""
        if self._plan is None:
            return serve_argv(self._model, port, kv_cfg, max_model_len=self._max_model_len, extra=self._extra[name])
        role = name[0]
        kv_addr = self._plan.addr(role, "d" if role == "p" else "p")
        return serve_argv(self._model, port, with_side_channel_host(kv_cfg, kv_addr),
                          max_model_len=self._max_model_len, extra=self._extra[name],
                          host=self._plan.addr(role, "x"))

    def _init_netns(self, kv_cfg: str) -> None:
        plan = self._plan
        assert plan is not None
        servers = {}
        for role, name, peer in (("p", "prefill", "x"), ("d", "decode", "x")):
            kv_peer = "d" if role == "p" else "p"
            kv_addr = plan.addr(role, kv_peer)  # side channel: bind and advertise on the P-D link
            host, port = plan.addr(role, peer), NETNS_PORTS[name]
            env = {**server_env(name), "UCX_TLS": "tcp", "UCX_NET_DEVICES": plan.dev(role, kv_peer),
                   "VLLM_HOST_IP": kv_addr}
            servers[name] = Server(name, self._serve_argv(name, port, kv_cfg), port, self.log_dir / f"{name}.log",
                                   env=env, host=host)
        self.prefill, self.decode = servers["prefill"], servers["decode"]
        x_host, x_port = plan.addr("x", "p"), NETNS_PORTS["proxy"]
        self.proxy = Server("proxy", [sys.executable, "-m", "lynx_connector.cli", "proxy", "--host", "0.0.0.0",
                                      "--port", str(x_port), "--prefill", self.prefill.url,
                                      "--decode", self.decode.url, *self._proxy_args],
                            x_port, self.log_dir / "proxy.log", env=dict(SERVER_ENV), host=x_host)
        self.servers = [self.prefill, self.decode, self.proxy]

    def restart_decode(self, kv_transfer_config: str, log_path: Path | None = None,
                       timeout: float | None = None, extra_args: list[str] | None = None) -> None:
        """Stop D and start it again on the same port (same arguments, a new KVTransferConfig, e.g. another
        link rate, and ``extra_args`` after the others, e.g. ``--max-num-seqs 2``), logging to ``log_path``; P
        and the proxy keep running."""
        d = self.decode
        d.stop()
        d.argv = self._serve_argv("decode", d.port, kv_transfer_config) + list(extra_args or [])
        if log_path is not None:
            d.log_path = Path(log_path)
        d.start()
        self._wait_healthy([d], self.startup_timeout if timeout is None else timeout)

    def restart_prefill(self, timeout: float | None = None) -> None:
        """Kill P (SIGKILL: no clean shutdown, as a crash) and start it again with the same arguments, on the
        same ports; D and the proxy keep running."""
        p = self.prefill
        p.stop(grace=0.0)
        p.start()
        self._wait_healthy([p], self.startup_timeout if timeout is None else timeout)

    def signal_prefill(self, sig: int) -> None:
        """Send ``sig`` to every process of P (e.g. SIGSTOP / SIGCONT: a P that goes silent, then resumes)."""
        assert self.prefill.proc is not None
        os.killpg(self.prefill.proc.pid, sig)

    def add_proxy(self, name: str, args: list[str]) -> Server:
        """One more ``lynx proxy`` in front of the same P and D (local deployments only; call before ``start()``),
        with ``args`` (e.g. ``["--flow", "sequential"]``): flows compared side by side in one run."""
        if self._plan is not None:
            raise ValueError("add_proxy supports local deployments only (not netns)")
        port = free_port()
        server = Server(name, [sys.executable, "-m", "lynx_connector.cli", "proxy", "--host", "127.0.0.1",
                               "--port", str(port), "--prefill", self.prefill.url, "--decode", self.decode.url,
                               *self._proxy_args, *args], port, self.log_dir / f"{name}.log",
                        env={**self.proxy.env})
        self.servers.append(server)
        return server

    @property
    def url(self) -> str:
        return self.proxy.url

    def client(self) -> contextlib.AbstractContextManager[None]:
        """Context in which ``self.url`` (the proxy) is reachable from the calling thread."""
        return self.proxy.reach()

    @property
    def kv_link(self) -> tuple[str, str] | None:
        """(namespace, device) of P's end of the P-D link in netns mode (for counters, faults), else None."""
        if self.topology is None:
            return None
        return self.prefill.netns, NetnsPlan.dev("p", "d")

    def __enter__(self) -> Deployment:
        atexit.register(self._stop_at_exit)
        if threading.current_thread() is threading.main_thread():  # a closed terminal (SIGHUP) stops it too
            self._old_handlers = {sig: signal.signal(sig, _raise_keyboard_interrupt) for sig in STOP_SIGNALS}
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        if self._plan is not None and self.topology is None:
            self.topology, names = self._plan.build()
            for server, role in ((self.prefill, "p"), (self.decode, "d"), (self.proxy, "x")):
                server.netns = names[role]
            logger.info("namespaces: prefill %s, decode %s, proxy %s (P-D link %s <-> %s)", names["p"],
                        names["d"], names["x"], self._plan.addr("p", "d"), self._plan.addr("d", "p"))
        t0 = time.monotonic()
        for s in self.servers:
            s.start()
        self._wait_healthy(self.servers, self.startup_timeout)
        self.startup_s = time.monotonic() - t0

    def _wait_healthy(self, servers: list[Server], timeout: float) -> None:
        """Raises :class:`StartupFailed` naming the server that exited, or those not healthy by ``timeout``."""
        deadline = time.monotonic() + timeout
        pending = list(servers)
        while pending:
            for s in list(pending):
                self.raise_if_exited("during start-up", [s])
                if s.healthy():
                    logger.info("%s healthy at %s", s.name, s.url)
                    pending.remove(s)
            if time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise StartupFailed(tuple(s.name for s in pending),
                                    f"{names} not healthy after {timeout:.0f} s; logs in {self.log_dir}")
            time.sleep(1.0)

    def raise_if_exited(self, during: str, servers: list[Server] | None = None) -> None:
        """:class:`StartupFailed` naming the first server (of ``servers``, default all) whose process exited,
        with its log's tail: a benchmark checks it between cells, whose results a dead server voids."""
        for s in self.servers if servers is None else servers:
            if s.proc is not None and s.proc.poll() is not None:
                raise StartupFailed((s.name,), f"{s.name} server exited with code {s.proc.returncode} {during}; "
                                               f"last log lines ({s.log_path}):\n{s.log_tail()}")

    def stop(self, reraise: bool = True) -> None:
        """Stop every server at once (one grace period, not one each) and remove the namespaces. A Ctrl-C, SIGTERM
        or SIGHUP meanwhile does not interrupt it (a half-done stop left servers running): it cuts the grace
        period short, killing them now, and is raised once the stop is done, unless it stopped an exception
        already (the first Ctrl-C) or ``reraise`` is False (at exit)."""
        hurried: list[int] = []
        main = threading.current_thread() is threading.main_thread()
        if main:
            during = {sig: signal.signal(sig, lambda signum, _frame: hurried.append(signum))
                      for sig in (signal.SIGINT, *STOP_SIGNALS)}
        try:
            if any(s.proc is not None for s in self.servers):
                logger.info("stopping %s", ", ".join(s.name for s in self.servers if s.proc is not None))
            stop_servers(list(reversed(self.servers)), hurry=lambda: bool(hurried))
        finally:
            if self.topology is not None:
                self.topology.destroy()
                self.topology = None
                for s in self.servers:
                    s.netns = None
            if main:
                for sig, handler in {**during, **self._old_handlers}.items():
                    signal.signal(sig, handler)
                self._old_handlers = {}
        atexit.unregister(self._stop_at_exit)
        if hurried and reraise and sys.exc_info()[0] is None:  # a Ctrl-C during a teardown nobody interrupted
            raise KeyboardInterrupt(f"signal {hurried[0]}")  # (e.g. a failed start's): the caller stops too

    def _stop_at_exit(self) -> None:
        self.stop(reraise=False)


class StartupFailed(RuntimeError):
    """A server exited (during start-up or later), or did not become healthy in time: ``servers`` names which."""

    def __init__(self, servers: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.servers = servers


#: Signals that stop a deployment (KeyboardInterrupt in the main thread; SIGINT raises it already).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def shell_assignments(role: str, model: str, port: int, kv_transfer_config: str, *, host: str = "127.0.0.1",
                      cpus: str | None = None, max_model_len: int = 4096, extra: list[str] | None = None) -> str:
    """Bash for one server of a script-driven deployment: ``ENV=(K=V ...)`` (:func:`server_env`) and
    ``ARGS=(serve MODEL ...)`` (:func:`serve_args`), shell-quoted, to ``eval`` (examples/1p1d/run_1p1d.sh)."""
    env = [f"{k}={v}" for k, v in server_env(role, cpus).items()]
    args = serve_args(model, port, kv_transfer_config, max_model_len=max_model_len, extra=extra, host=host)
    return (f"ENV=({' '.join(shlex.quote(e) for e in env)})\n"
            f"ARGS=({' '.join(shlex.quote(a) for a in args)})\n")


def main(argv: list[str] | None = None) -> int:
    """Start a deployment and keep it up until Ctrl-C / SIGTERM (then tear everything down); with ``--shell
    ROLE``, print that server's environment and ``lynx`` arguments for a script instead."""
    ap = argparse.ArgumentParser(prog="python -m lynx_connector.lab.launch", description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--log-dir", default="lynx-logs")
    ap.add_argument("--kv-transfer-config", default="lynx")
    ap.add_argument("--netns", action="store_true", help="P, D and the proxy in their own network namespaces")
    ap.add_argument("--link-mbit", type=float, default=None, help="tc tbf rate on the P-D veth (netns only)")
    ap.add_argument("--startup-timeout", type=float, default=420.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--serve-args", default="", help="extra `lynx serve` arguments for P and D, one string "
                    "(later values override the CPU defaults, e.g. '--dtype bfloat16')")
    ap.add_argument("--shell", choices=("prefill", "decode"), default=None,
                    help="print bash ENV=(...) and ARGS=(...) of that server (with --port, --host, --cpus) and exit")
    ap.add_argument("--port", type=int, default=None, help="with --shell: the server's port")
    ap.add_argument("--host", default="127.0.0.1", help="with --shell: the address the server listens on")
    ap.add_argument("--cpus", default=None, help="with --shell: its VLLM_CPU_OMP_THREADS_BIND (default: half "
                    "of the cores each)")
    args = ap.parse_args(argv)
    extra = shlex.split(args.serve_args)
    if args.shell is not None:
        if args.port is None:
            ap.error("--shell needs --port")
        sys.stdout.write(shell_assignments(args.shell, args.model, args.port, args.kv_transfer_config,
                                           host=args.host, cpus=args.cpus, max_model_len=args.max_model_len,
                                           extra=extra))
        return 0
    dep = Deployment(args.model, Path(args.log_dir), kv_transfer_config=args.kv_transfer_config,
                     startup_timeout=args.startup_timeout, netns=args.netns, link_mbit=args.link_mbit,
                     max_model_len=args.max_model_len, extra_serve_args=extra)
    up = False
    try:
        with dep:
            up = True
            for s in dep.servers:  # process groups: each server's pid is its group's
                assert s.proc is not None
                sys.stdout.write(f"{s.name} at {s.url} (pid {s.proc.pid}, log {s.log_path})\n")
            where = f" (inside: ip netns exec {dep.proxy.netns} ...)" if args.netns else ""
            sys.stdout.write(f"proxy at {dep.url}{where}; Ctrl-C stops everything\n")
            sys.stdout.flush()
            while all(s.proc is not None and s.proc.poll() is None for s in dep.servers):
                time.sleep(1.0)
            logger.error("a server exited; stopping the deployment (logs in %s)", dep.log_dir)
            return 1
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: once everything was up, the way to stop it (exit 0)
        sys.stderr.write("servers stopped\n" if up else "interrupted during start-up; servers stopped\n")
        return 0 if up else 130


if __name__ == "__main__":
    raise SystemExit(main())
