"""``lynx_connector.lab.launch.Deployment`` without servers: the argv and environment each role gets, and
``restart_decode`` (a new KVTransferConfig for D, its own arguments kept, P and the proxy untouched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lynx_connector.lab import launch
from lynx_connector.lab.launch import Deployment


def _kv(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_roles_get_their_arguments_and_environment(tmp_path: Path) -> None:
    dep = Deployment("MODEL", tmp_path, kv_transfer_config='{"kv_connector": "lynx"}', extra_serve_args=["--a"],
                     decode_serve_args=["--only-d"], prefill_env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
                     decode_env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    p, d = dep.prefill.argv, dep.decode.argv
    assert "--a" in p and "--only-d" not in p and d[-2:] == ["--a", "--only-d"]
    assert p[p.index("--block-size") + 1] == "32" and dep.prefill.env["LYNX_SERVERS_PER_DEVICE"] == "2"
    assert (dep.prefill.env["VLLM_CPU_OMP_THREADS_BIND"], dep.decode.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert dep.startup_s is None


def test_restart_decode_replaces_only_ds_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(launch.Server, "start", lambda self: calls.append(("start", self.name)))
    monkeypatch.setattr(launch.Server, "stop", lambda self, grace=15.0: calls.append(("stop", self.name)))
    monkeypatch.setattr(launch.Server, "healthy", lambda self: True)
    dep = Deployment("MODEL", tmp_path, kv_transfer_config='{"kv_connector": "lynx"}', decode_serve_args=["--s"])
    p_argv, port = list(dep.prefill.argv), dep.decode.port
    dep.restart_decode('{"kv_connector": "lynx", "kv_connector_extra_config": {"link_gbps": 0.5}}',
                       tmp_path / "decode1.log")
    assert calls == [("stop", "decode"), ("start", "decode")]
    assert _kv(dep.decode.argv)["kv_connector_extra_config"] == {"link_gbps": 0.5}
    assert dep.decode.argv[-1] == "--s" and dep.decode.port == port and dep.prefill.argv == p_argv
    assert dep.decode.log_path == tmp_path / "decode1.log"


def test_netns_restart_keeps_the_side_channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.Server, "start", lambda self: None)
    monkeypatch.setattr(launch.Server, "stop", lambda self, grace=15.0: None)
    monkeypatch.setattr(launch.Server, "healthy", lambda self: True)
    dep = Deployment("MODEL", tmp_path, netns=True)
    dep.restart_decode('{"kv_connector": "lynx", "kv_connector_extra_config": {"link_gbps": 1}}')
    extra = _kv(dep.decode.argv)["kv_connector_extra_config"]
    assert (extra["link_gbps"], extra["side_channel_host"]) == (1, "10.213.3.2")
    assert dep.decode.argv[dep.decode.argv.index("--host") + 1] == "10.213.2.2"


#: A server still starting, as vLLM's API server is: it ignores SIGTERM, and has a child in its process group.
STUBBORN = ("import os, signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n")


def _stubborn(dep: Deployment) -> list[int]:
    """Start dep's servers as STUBBORN processes; returns every pid (leaders and children)."""
    import sys
    import time

    pids = []
    for s in dep.servers:
        s.argv = [sys.executable, "-c", STUBBORN]
        s.log_path.unlink(missing_ok=True)  # its first line is this start's child pid: the SIGTERM is ignored by then
        s.start()
        assert s.proc is not None
        pids.append(s.proc.pid)
    for s in dep.servers:
        deadline = time.monotonic() + 30
        while not s.log_path.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids.append(int(s.log_path.read_text().split()[0]))
    return pids


def _gone(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return open(f"/proc/{pid}/stat").read().split()[2] == "Z"  # a zombie: dead, not yet reaped by its parent


def _wait_gone(pids: list[int], within: float = 10.0) -> None:
    """The leaders are reaped by stop; their SIGKILLed children may take a moment more to disappear."""
    import time

    deadline = time.monotonic() + within
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]


def test_stop_waits_one_grace_for_all_servers_and_kills_their_children(tmp_path: Path) -> None:
    """Servers that ignore SIGTERM (vLLM while it starts) get one grace period together, not one each (review:
    15 s per server, 30-45 s silent after a Ctrl-C during start-up), then their whole groups are killed."""
    import time

    dep = Deployment("MODEL", tmp_path, kv_transfer_config="lynx")
    pids = _stubborn(dep)
    t0 = time.monotonic()
    launch.stop_servers(dep.servers, grace=3.0)
    assert time.monotonic() - t0 < 7.0  # one 3 s grace for the three, not three (9 s)
    _wait_gone(pids)
    assert all(s.proc is None for s in dep.servers)
    dep.stop()  # nothing left to stop


def test_a_second_interrupt_during_stop_kills_at_once_and_is_not_lost_midway(tmp_path: Path) -> None:
    """Ctrl-C (or SIGTERM, SIGHUP) again while the deployment stops: the grace period is cut short and every
    group killed (review: the second Ctrl-C interrupted the wait after the server's ``proc`` was cleared, so
    nothing ever sent SIGKILL: the server hung on, and the launcher exited 0)."""
    import os
    import signal
    import threading
    import time

    dep = Deployment("MODEL", tmp_path, kv_transfer_config="lynx")
    pids = _stubborn(dep)
    stray: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, _frame: stray.append(signum))  # never pytest's
    timers = [threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)) for _ in range(2)]
    try:
        timers[0].start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):  # a stop nobody interrupted: the Ctrl-C is the caller's after it
            dep.stop()  # a 15 s grace, cut short by the SIGINT
        assert time.monotonic() - t0 < 10.0 and stray == []
        _wait_gone(pids)
        pids = _stubborn(dep)
        timers[1].start()
        dep.stop(reraise=False)  # at exit: nobody to tell
        _wait_gone(pids)
        assert stray == []
    finally:
        for timer in timers:  # no SIGINT may reach pytest after this test
            timer.cancel()
            if timer.is_alive():
                timer.join()
        signal.signal(signal.SIGINT, before)


def test_a_server_that_exits_is_named(tmp_path: Path) -> None:
    """Start-up and the benchmarks' between-cell check name the server that exited (the e2e bench retries without
    the speculative scheduler only when D alone failed: review, it blamed a P killed during start-up on D)."""
    import sys

    dep = Deployment("MODEL", tmp_path, kv_transfer_config="lynx", startup_timeout=30)
    for s in dep.servers:
        s.argv = [sys.executable, "-c", STUBBORN]
    dep.prefill.argv = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    try:
        with pytest.raises(launch.StartupFailed, match="prefill server exited with code 3 during start-up") as exc:
            dep.start()
        assert exc.value.servers == ("prefill",) and "boom" in str(exc.value)
        dep.stop()  # stopped servers are not exited ones
        dep.raise_if_exited("now")
        dep.decode.start()
        dep.raise_if_exited("now")
        dep.decode.proc.kill()  # type: ignore[union-attr]
        dep.decode.proc.wait(10)  # type: ignore[union-attr]
        with pytest.raises(launch.StartupFailed, match="decode server exited with code -9 between cells") as exc:
            dep.raise_if_exited("between cells")
        assert exc.value.servers == ("decode",)
    finally:
        dep.stop()


def test_the_launcher_interrupted_during_start_up_exits_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Interrupted before everything was up, the launcher says so and exits 130 (review: exit 0, silent); stopped
    once up (SIGTERM: tests/deploy/test_examples_real.py) it exits 0, the normal way to stop it."""

    class Interrupted:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __enter__(self):
            raise KeyboardInterrupt

        def __exit__(self, *exc) -> None:
            pass

    monkeypatch.setattr(launch, "Deployment", Interrupted)
    assert launch.main(["MODEL", "--log-dir", str(tmp_path)]) == 130
    assert "interrupted during start-up; servers stopped" in capsys.readouterr().err
