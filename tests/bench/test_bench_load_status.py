"""The load bench's reader of the transports' status files (lab/bench/load.py read_status): it sums the live
workers' counters and skips the last file of a worker that no longer runs (a P killed and restarted leaves one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lynx_connector.lab.bench.load import read_status
from lynx_connector.transport.status import StatusWriter, writer_alive


def _source(path, pid: int, live: int) -> None:
    path.write_text(json.dumps({"pid": pid, "source": {"requests_live": live, "bytes_allocated": live << 20}}))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_status_files_of_dead_writers_are_skipped(tmp_path):
    dead = _dead_pid()
    _source(tmp_path / "old-src.json", dead, 1)  # the killed P's last word: one request staged
    _source(tmp_path / "new-src.json", os.getpid(), 2)
    assert not writer_alive({"pid": dead}) and writer_alive({"pid": os.getpid()})
    assert read_status(tmp_path)["p_staged_requests"] == 2.0
    os.remove(tmp_path / "new-src.json")
    assert read_status(tmp_path)["p_staged_requests"] == 0.0


def test_writer_names_its_pid(tmp_path):
    path = tmp_path / "w.json"
    StatusWriter(str(path), lambda: {"source": {"requests_live": 3, "bytes_allocated": 0}}).maybe_write()
    body = json.loads(path.read_text())
    assert body["pid"] == os.getpid() and writer_alive(body)
    assert read_status(tmp_path)["p_staged_requests"] == 3.0
    assert writer_alive({"source": {}})  # a file without a pid (older writer) counts as live


def test_the_writer_never_follows_a_planted_link(tmp_path):
    """The temporary file had a fixed name (``<file>.tmp``): in a status_dir others can write to, a link planted at
    that name made the writer overwrite the file it pointed to."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = tmp_path / "w.json"
    os.symlink(victim, f"{path}.tmp")
    StatusWriter(str(path), lambda: {"source": {}}).maybe_write()
    assert victim.read_text() == "keep" and json.loads(path.read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim", "w.json", "w.json.tmp"]  # no temporary left
    assert os.stat(path).st_mode & 0o777 == 0o644


def test_an_unreadable_deployment_is_not_idle_and_one_failure_is_never_100_percent():
    """A P, D or proxy that cannot be read gave empty readings, which read as idle ("idle after: yes"); the
    success rate was rounded to 4 decimals before the exit status was judged on it."""
    from types import SimpleNamespace

    from lynx_connector.lab.bench import load

    unreadable = SimpleNamespace(snapshot=lambda: {"t": 0.0})
    assert load.wait_idle(unreadable, timeout=0.0)["idle"] is False
    zeros = SimpleNamespace(snapshot=lambda: dict.fromkeys(load.IDLE_KEYS, 0))
    assert load.wait_idle(zeros, timeout=0.0)["idle"] is True
    rows = [{"ok": i != 0, "ttft_s": 0.1, "e2e_s": 0.2, "error": None if i else "HTTP 500"} for i in range(20_000)]
    summary = load.summarize("soak", rows)
    assert summary["success_rate"] < 1.0 and summary["answered"] == 19_999
    cfg = {"kv_transfer_config": "lynx", "proxy_args": [], "modes": ["full"], "words": [1, 2], "max_tokens": 4}
    md = load.markdown({"phases": [summary], "idle_after": {"soak": {"idle": True}}, "config": cfg, "samples": []})
    assert "99.995%" in md and "100.0%" not in md


def test_a_server_that_exits_ends_the_load_run_and_fails_it() -> None:
    """A dead P or D made every later request fail and the run still exited 0 through ``lynx bench load``: the
    phase's end names the server (its code and log tail), the table says so, the exit status is 1."""
    from types import SimpleNamespace

    from lynx_connector.lab.bench import load
    from lynx_connector.lab.launch import StartupFailed

    def dead(during: str) -> None:
        raise StartupFailed(("decode",), f"decode server exited with code -9 {during}; last log lines (d.log):\nOOM")

    assert load.server_exited(SimpleNamespace(raise_if_exited=lambda during: None), "burst32") is None
    said = load.server_exited(SimpleNamespace(raise_if_exited=dead), "burst32")
    assert said is not None and said.startswith("decode server exited with code -9 by the end of burst32")
    rows = [{"ok": True, "ttft_s": 0.1, "e2e_s": 0.2, "error": None}]
    summary = load.summarize("burst32", rows)
    cfg = {"kv_transfer_config": "lynx", "proxy_args": [], "modes": ["full"], "words": [1, 2], "max_tokens": 4}
    result = {"phases": [summary], "idle_after": {"burst32": {"idle": True}}, "config": cfg, "samples": [],
              "server_exited": said}
    assert "A server exited" in load.markdown(result) and "code -9" in load.markdown(result)
    assert load.exit_status(result) == 1
    assert load.exit_status({**result, "server_exited": None}) == 0
    assert load.exit_status({**result, "server_exited": None,
                             "phases": [load.summarize("burst32", [{**rows[0], "ok": False}])]}) == 1
