"""examples/1p1d/run_1p1d.sh with a stub `lynx` (a tiny HTTP server per role that also spawns a child): the
script starts P, D and the proxy, waits for /health, asks one question, and its trap leaves no process behind,
on a normal exit, on SIGTERM while it keeps the deployment up, and when a server dies during start-up."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "1p1d" / "run_1p1d.sh"
pytestmark = pytest.mark.timeout(120)

STUB = r'''#!PYTHON
import http.server, json, os, subprocess, sys
args = sys.argv[1:]
role, port = args[0], int(args[args.index("--port") + 1])
if role == "serve" and os.environ.get("STUB_FAIL_SERVE"):
    sys.exit(3)
if os.environ.get("STUB_IGNORE_TERM"):                 # as vLLM's server while it starts
    import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "300"])            # a grandchild: the trap must kill the whole group
with open(os.path.join(os.environ["STUB_DIR"], f"{role}-{port}.pids"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
if role == "serve":
    json.loads(args[args.index("--kv-transfer-config") + 1])   # valid JSON
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self): self._send({})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"])); self._send({"choices": [{"text": " Paris."}]})
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(tmp_path: Path, **extra: str) -> dict[str, str]:
    stub = tmp_path / "lynx"
    stub.write_text(STUB.replace("PYTHON", sys.executable))
    stub.chmod(0o755)
    (tmp_path / "pids").mkdir()
    return {**os.environ, "LYNX": str(stub), "PYTHON": sys.executable, "MODEL": "stub-model",
            "STUB_DIR": str(tmp_path / "pids"), "LOG_DIR": str(tmp_path / "logs"), "STARTUP_TIMEOUT": "30",
            "P_PORT": str(_free_port()), "D_PORT": str(_free_port()), "PROXY_PORT": str(_free_port()), **extra}


def _all_pids(tmp_path: Path) -> list[int]:
    return [int(p) for f in (tmp_path / "pids").glob("*.pids") for p in f.read_text().split()]


def _assert_all_gone(pids: list[int], within: float = 10.0) -> None:
    end = time.monotonic() + within
    alive = pids
    while alive and time.monotonic() < end:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and
                 not Path(f"/proc/{p}/stat").read_text().split()[2] == "Z"]
        time.sleep(0.1)
    assert not alive, f"left running: {alive}"


def test_runs_asks_and_tears_down(tmp_path: Path) -> None:
    env = _setup(tmp_path)
    res = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "answer in" in res.stdout and "Paris" in res.stdout, res.stdout
    pids = _all_pids(tmp_path)
    assert len(pids) == 6  # prefill, decode, proxy + a child each
    _assert_all_gone(pids)


def _hup_default() -> None:
    """Under ``nohup`` (a CI runner, a detached run) SIGHUP is ignored, and bash cannot trap a signal ignored when
    it started: the script's HUP trap would never run."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _kill_leftovers(pids: list[int]) -> None:
    """A failed test must not leave its stub servers (they ignore SIGTERM) running for the rest of the suite."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _kept_up(env: dict[str, str]) -> subprocess.Popen:
    """The script with KEEP=1, once it says the deployment is up."""
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=_hup_default)
    end = time.monotonic() + 60
    for line in proc.stdout:  # type: ignore[union-attr]
        if "Ctrl-C stops everything" in line:
            return proc
        if time.monotonic() > end:
            break
    proc.kill()
    raise AssertionError("the script did not say the deployment was up")


def test_sigterm_while_kept_up_tears_down(tmp_path: Path) -> None:
    env = _setup(tmp_path, KEEP="1")
    proc = _kept_up(env)
    try:
        pids = _all_pids(tmp_path)
        assert len(pids) == 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 143
        _assert_all_gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_server_dying_at_startup_fails_fast_and_cleans_up(tmp_path: Path) -> None:
    # fails fast: well before its start-up timeout (300 s here), whatever the machine's load (the script runs
    # the launcher's Python twice for the servers' arguments, seconds on a loaded 2-core box)
    env = _setup(tmp_path, STUB_FAIL_SERVE="1", STARTUP_TIMEOUT="300")
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "prefill exited" in res.stdout, res.stdout + res.stderr
    assert time.monotonic() - t0 < 60
    _assert_all_gone(_all_pids(tmp_path))


def test_servers_get_the_launchers_arguments_and_environment(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """One builder: the script starts P and D with lynx_connector.lab.launch's serve_args and server_env
    (CPU defaults: block size 32, LYNX_SERVERS_PER_DEVICE=2) that the demo and the benches use."""
    import shlex

    from lynx_connector.lab.launch import SERVER_ENV, serve_args, server_env

    env = _setup(tmp_path, P_CPUS="0", EXTRA_SERVE_ARGS="--max-num-seqs 4")
    # the script leaves a variable the caller already set alone (scripts/test.sh exports some of SERVER_ENV)
    for key in (*SERVER_ENV, "VLLM_CPU_OMP_THREADS_BIND"):
        env.pop(key, None)
        monkeypatch.delenv(key, raising=False)  # server_env() below reads this process's environment
    res = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    for role, port, cpus in (("prefill", env["P_PORT"], "0"), ("decode", env["D_PORT"], None)):
        cmd = shlex.split((tmp_path / "logs" / f"{role}.log").read_text().splitlines()[0])[1:]
        if cpus:
            assert cmd[:3] == ["taskset", "-c", cpus]
            cmd = cmd[3:]
        at = cmd.index(env["LYNX"])
        assert cmd[0] == "env" and dict(a.split("=", 1) for a in cmd[1:at]) == server_env(role, cpus)
        args = cmd[at + 1:]
        kv = args[args.index("--kv-transfer-config") + 1]
        assert args == serve_args("stub-model", int(port), kv, extra=["--max-num-seqs", "4"])
        assert args[args.index("--block-size") + 1] == "32"


@pytest.mark.parametrize("first,second", [(signal.SIGTERM, signal.SIGINT), (signal.SIGHUP, signal.SIGTERM)])
def test_a_second_signal_during_teardown_kills_at_once(tmp_path: Path, first: int, second: int) -> None:
    """Servers that ignore SIGTERM hold the teardown for its 15 s; a second Ctrl-C (or SIGTERM) then kills them
    at once, and the script still says it stopped (review: the second signal killed the script mid-teardown and
    left the servers running). A closed terminal (SIGHUP) stops everything too."""
    env = _setup(tmp_path, KEEP="1", STUB_IGNORE_TERM="1")
    proc = _kept_up(env)
    try:
        pids = _all_pids(tmp_path)
        proc.send_signal(first)
        # the second signal comes once the stop has begun (two signals bash finds pending at once run one trap)
        assert "stopping the servers" in proc.stdout.readline()  # type: ignore[union-attr]
        time.sleep(1.0)
        assert proc.poll() is None  # waiting for the servers that ignore SIGTERM
        t0 = time.monotonic()
        proc.send_signal(second)
        assert proc.wait(10) == {signal.SIGTERM: 143, signal.SIGHUP: 129}[first]
        assert time.monotonic() - t0 < 8.0
        assert "[1p1d] stopped" in proc.stdout.read()  # type: ignore[union-attr]
        _assert_all_gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _kill_leftovers(_all_pids(tmp_path))

