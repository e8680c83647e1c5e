"""Start and stop a 1P1D deployment on one machine: a prefill server, a decode server (``lynx serve``, i.e.
``vllm serve`` with the plugin) and the proxy, each in its own process group, logs in a folder.

Used by the demo, the end-to-end benchmark and the server tests. Teardown is guaranteed: ``Deployment`` is a
context manager, registers an atexit hook and turns SIGTERM into a normal exit, so no server outlives it,
also on Ctrl-C or failure.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lynx_connector.logger import init_logger

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

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ)
        env.update(self.env)
        self._log = open(self.log_path, "ab")
        # A process group of its own: teardown signals the server and every child it spawned.
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        logger.info("started %s (pid %s): %s", self.name, self.proc.pid, " ".join(self.argv))

    def healthy(self) -> bool:
        try:
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
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:  # the group may hold children that outlived the leader
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %s) did not exit after SIGKILL", self.name, proc.pid)
        self._log.close()


def serve_argv(model: str, port: int, kv_transfer_config: str, *, max_model_len: int = 4096,
               extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "lynx_connector.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len), "--block-size", "32",
            "--max-num-seqs", "8", "--max-num-batched-tokens", str(max_model_len), "--seed", "0",
            "--no-enable-prefix-caching", "--kv-transfer-config", kv_transfer_config, *(extra or [])]


SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false",
              "PYTHONHASHSEED": "0"}


class Deployment:
    """P + D + proxy. ``kv_transfer_config`` is what both servers get (the preset ``lynx`` by default)."""

    def __init__(self, model: str, log_dir: Path, *, kv_transfer_config: str = "lynx",
                 max_model_len: int = 4096, startup_timeout: float = 420.0, extra_serve_args: list[str] | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout = startup_timeout
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        env = dict(SERVER_ENV)
        self.prefill = Server("prefill", serve_argv(model, p_port, kv_transfer_config, max_model_len=max_model_len,
                                                    extra=extra_serve_args),
                              p_port, self.log_dir / "prefill.log", env=dict(env))
        self.decode = Server("decode", serve_argv(model, d_port, kv_transfer_config, max_model_len=max_model_len,
                                                  extra=extra_serve_args),
                             d_port, self.log_dir / "decode.log", env=dict(env))
        self.proxy = Server("proxy", [sys.executable, "-m", "lynx_connector.cli", "proxy", "--host", "127.0.0.1",
                                      "--port", str(x_port), "--prefill", self.prefill.url,
                                      "--decode", self.decode.url],
                            x_port, self.log_dir / "proxy.log", env=dict(env))
        self.servers = [self.prefill, self.decode, self.proxy]
        self._old_sigterm: Any = None

    @property
    def url(self) -> str:
        return self.proxy.url

    def __enter__(self) -> Deployment:
        atexit.register(self.stop)
        self._old_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        for s in self.servers:
            s.start()
        deadline = time.monotonic() + self.startup_timeout
        pending = list(self.servers)
        while pending:
            for s in list(pending):
                if s.proc is not None and s.proc.poll() is not None:
                    raise RuntimeError(f"{s.name} server exited with code {s.proc.returncode} during start-up; "
                                       f"last log lines ({s.log_path}):\n{s.log_tail()}")
                if s.healthy():
                    logger.info("%s healthy at %s", s.name, s.url)
                    pending.remove(s)
            if time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise TimeoutError(f"{names} not healthy after {self.startup_timeout:.0f} s; logs in {self.log_dir}")
            time.sleep(1.0)

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()
        atexit.unregister(self.stop)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
