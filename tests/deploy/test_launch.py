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
