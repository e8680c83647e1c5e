"""Every way the project starts P and D, run for real on this CPU machine with the real model, one real request
through each (issue 18.6):

* examples/1p1d/run_1p1d.sh, as its header says (``lynx`` on PATH), kept up (KEEP=1) so that D's counters and a
  second decode server can be checked, then stopped with SIGTERM: nothing left behind;
* the image's command: the Dockerfile's ENTRYPOINT with the arguments and environment of the Kubernetes
  manifest (examples/k8s/1p1d.yaml: ``lynx serve $(MODEL) ... --kv-transfer-config {...$(LYNX_MODE)...}``,
  the ConfigMap's environment, the image's ENV), only the model, the pod address and the ports replaced;
* the launcher's command line, ``python -m lynx_connector.lab.launch MODEL``, stopped with SIGTERM.

None of them sets a KV cache size: ``lynx serve``'s memory defaults (lynx_connector/memory.py) must let P and D
start side by side (vLLM's own CPU default refuses to start on a machine with less than 92% of its memory free).
A decode server started another way (``python -m vllm.entrypoints.openai.api_server``, vLLM's default block
size 128) next to the script's P (block size 32) is served: P and D may differ in block size (issue 18.4).

Engines are started only here and under the slow marker; run under ``flock /tmp/lynx-slow.lock``."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from lynx_connector.lab.launch import Server, cpu_binding, free_port, serve_args, server_env
from lynx_connector.lab.models import model_dir
from lynx_connector.memory import SERVERS_ENV, GiB, cpu_kv_cache_bytes, machine_memory_bytes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "1p1d" / "run_1p1d.sh"
DOCKERFILE = ROOT / "examples" / "Dockerfile"
MANIFEST = ROOT / "examples" / "k8s" / "1p1d.yaml"
BIN = Path(sys.executable).parent
STARTUP_S = 420.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True)
def _no_memory_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in the environment chooses the memory: the defaults under test apply."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv(SERVERS_ENV, raising=False)


@pytest.fixture(scope="module")
def model() -> str:
    path = model_dir()
    if not path.exists():
        pytest.skip("the model is not prepared (lynx prepare-model)")
    return str(path)


def _complete(url: str, model: str, prompt: str = "The capital of France is", timeout: float = 300) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def _metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus series of ``url``/metrics whose label set contains ``labels``."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def _wait_healthy(servers: list[Server], timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    for s in servers:
        while not s.healthy():
            assert s.proc is not None and s.proc.poll() is None, f"{s.name} exited:\n{s.log_tail(40)}"
            assert time.monotonic() < deadline, f"{s.name} not healthy after {timeout:.0f} s:\n{s.log_tail(40)}"
            time.sleep(1.0)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _pids_in_group(pgid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _kill_leftover_groups(groups: list[int]) -> None:
    """After a failed test: SIGKILL what is left of the servers' process groups (only processes of this
    project's servers: a command line naming lynx or vLLM)."""
    for g in groups:
        mine = []
        for pid in _pids_in_group(g):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            mine.append("lynx" in cmd or "vllm" in cmd.lower())
        if any(mine):  # a group led by one of the servers (its children: engine, workers, resource tracker)
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _assert_gone(pids: list[int], within: float = 30.0) -> None:
    end = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], f"left running: {[p for p in pids if _alive(p)]}"


def _assert_lynx_memory_default(log: str, servers: int) -> None:
    """``lynx serve`` chose the KV cache (nobody set one) for ``servers`` on this machine, and vLLM used it."""
    want = cpu_kv_cache_bytes(machine_memory_bytes(), servers)
    assert f"'kv_cache_memory_bytes': {want}," in log, log[-3000:]
    assert f"Explicitly set ({want / GiB:.1f}/" in log, log[-3000:]
    assert "less than desired CPU memory utilization" not in log


def _assert_d_pulled(d_url: str) -> None:
    assert _metric(d_url, "vllm:lynx_transfer_bytes_total", 'stream="anchor"') > 0


@contextmanager
def _servers(*servers: Server) -> Iterator[None]:
    try:
        for s in servers:
            s.start()
        yield
    finally:
        for s in reversed(servers):
            if s.proc is not None:
                s.stop()


@pytest.mark.extended  # the launcher test below starts the same 1P1D; tests/deploy/test_launcher_script.py covers the script
def test_example_script_for_real(model: str, tmp_path: Path) -> None:
    """run_1p1d.sh as its header says: P and D with the launcher's arguments (block size 32) and environment,
    the proxy, one request; D pulled the KV. While it is up, a D started with vLLM's own entry point and its
    default block size (128) pulls from the same P (block size 32) and answers the same (heterogeneous P and D,
    issue 18.4); then SIGTERM stops every process of the script."""
    key = secrets.token_hex(32)
    p_port, d_port, x_port = free_port(), free_port(), free_port()
    env = dict(os.environ)
    env.update(PATH=f"{BIN}:{env.get('PATH', '')}", PYTHON=sys.executable, KEEP="1", LOG_DIR=str(tmp_path / "logs"),
               P_PORT=str(p_port), D_PORT=str(d_port), PROXY_PORT=str(x_port), SIDE_PORT="0",
               LYNX_SIDE_CHANNEL_KEY=key, STARTUP_TIMEOUT=str(int(STARTUP_S)))
    assert shutil.which("lynx", path=env["PATH"]) == str(BIN / "lynx")
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out: list[str] = []
    try:
        deadline = time.monotonic() + STARTUP_S + 120
        for line in proc.stdout:  # type: ignore[union-attr]
            out.append(line)
            if "Ctrl-C stops everything" in line:
                break
            assert time.monotonic() < deadline, "".join(out)
        text = "".join(out)
        answer = re.search(r"\[1p1d\] answer in [\d.]+s: '(.*)'", text)
        assert answer and answer.group(1).strip(), text
        logs = tmp_path / "logs"
        for role in ("prefill", "decode"):
            _assert_lynx_memory_default((logs / f"{role}.log").read_text(errors="replace"), servers=2)
        d_url = f"http://127.0.0.1:{d_port}"
        _assert_d_pulled(d_url)
        pgids = [int(m) for m in re.findall(r"\[1p1d\] \w+ pid (\d+)", text)]
        assert len(pgids) == 3, text
        pids = [p for g in pgids for p in _pids_in_group(g)]

        ref = _complete(f"http://127.0.0.1:{x_port}", model, timeout=120)["choices"][0]["text"]  # the script's D
        _api_server_decode_at_vllms_block_size(model, f"http://127.0.0.1:{p_port}", key, tmp_path, ref)

        os.killpg(proc.pid, signal.SIGTERM)  # the script's own group: bash (its trap) and nothing else
        assert proc.wait(60) == 143
        _assert_gone(pids)
    finally:  # on a failure too: the script's trap stops its servers on SIGTERM; whatever is left is killed
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        _kill_leftover_groups([int(m) for m in re.findall(r"\[1p1d\] \w+ pid (\d+)", "".join(out))])


def _api_server_decode_at_vllms_block_size(model: str, p_url: str, key: str, tmp_path: Path, answer: str) -> None:
    """D from ``python -m vllm.entrypoints.openai.api_server`` with the launcher's arguments minus its block
    size (vLLM's CPU default, 128) and with a KV cache size of its own (vLLM's entry point has none of ``lynx
    serve``'s defaults); a ``lynx proxy`` in front of the running P (block size 32) and it: D pulls P's KV and
    answers as the script's own D did."""
    d_port, x_port = free_port(), free_port()
    args = serve_args(model, d_port, "lynx")[2:]  # without "serve MODEL"
    at = args.index("--block-size")
    assert args[at + 1] == "32"
    del args[at:at + 2]
    d = Server("decode-api", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *args,
                              "--kv-cache-memory-bytes", str(1 << 30)], d_port, tmp_path / "decode-api.log",
               env={**server_env("decode"), "LYNX_SIDE_CHANNEL_KEY": key})
    x = Server("proxy-api", [str(BIN / "lynx"), "proxy", "--host", "127.0.0.1", "--port", str(x_port),
                             "--prefill", p_url, "--decode", d.url], x_port, tmp_path / "proxy-api.log")
    with _servers(d, x):
        _wait_healthy([d, x])
        out = _complete(x.url, model, timeout=120)
        _assert_d_pulled(d.url)
        assert _metric(d.url, "vllm:cache_config_info", 'block_size="128"') > 0  # really vLLM's default
    assert out["choices"][0]["text"] == answer, (out, answer)  # greedy: as the script's own D (block size 32)


def _image_entrypoint_and_env() -> tuple[list[str], dict[str, str]]:
    """The Dockerfile's ENTRYPOINT (exec form) and its ENV (``K=V`` pairs, continued lines joined)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    (entry,) = re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.*)$", text, re.M):
        env.update(kv.split("=", 1) for kv in line.split())
    return json.loads(entry), env


def _manifest_container(kind: str, name: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        if doc and doc["kind"] == kind and doc["metadata"]["name"] == name:
            (c,) = doc["spec"]["template"]["spec"]["containers"]
            return c
    raise KeyError((kind, name))


def _configmap() -> dict[str, str]:
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        if doc and doc["kind"] == "ConfigMap":
            return dict(doc["data"])
    raise KeyError("ConfigMap")


def _image_command(container: dict[str, Any], variables: dict[str, str], port: int,
                   side_port: int | None = None) -> list[str]:
    """The container's argv (ENTRYPOINT + args, ``$(VAR)`` expanded as Kubernetes does) with this test's ports."""
    entry, _ = _image_entrypoint_and_env()
    assert entry == ["lynx"], entry
    argv = [re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], a) for a in container["args"]]
    assert "--port=8000" in argv, argv
    argv = [f"--port={port}" if a == "--port=8000" else a for a in argv]
    if side_port is not None:
        argv = [a.replace('"side_channel_port": 5600', f'"side_channel_port": {side_port}') for a in argv]
        assert f'"side_channel_port": {side_port}' in " ".join(argv), argv
    return [str(BIN / entry[0]), *argv]


@pytest.mark.extended  # vLLM compiles the model (torch.compile, as the image runs it): about 3 min of start-up
def test_image_command_for_real(model: str, tmp_path: Path) -> None:
    """P, D and the proxy as the image runs them in examples/k8s/1p1d.yaml: no engine flag but the manifest's
    (the model's dtype, vLLM's block size and compilation, the ConfigMap's mode), memory from ``lynx serve``."""
    _, image_env = _image_entrypoint_and_env()
    image_env.pop("HF_HOME")  # the image's cache folder; here the user's (the model is a local folder anyway)
    cm = _configmap()
    key_file = tmp_path / "side-channel-key"
    key_file.write_text(secrets.token_hex(32))
    key_file.chmod(0o400)
    pod_env = {**image_env, **{k: v for k, v in cm.items() if k != "MODEL"}, "POD_IP": "127.0.0.1",
               "VLLM_HOST_IP": "127.0.0.1", "LYNX_SIDE_CHANNEL_KEY_FILE": str(key_file), "HF_HUB_OFFLINE": "1"}
    variables = {**pod_env, "MODEL": model}
    p_port, d_port, x_port, side = free_port(), free_port(), free_port(), free_port()
    p = Server("prefill", _image_command(_manifest_container("StatefulSet", "lynx-prefill"), variables, p_port, side),
               p_port, tmp_path / "prefill.log", env={**pod_env, **cpu_binding("prefill")})
    d = Server("decode", _image_command(_manifest_container("StatefulSet", "lynx-decode"), variables, d_port),
               d_port, tmp_path / "decode.log", env={**pod_env, **cpu_binding("decode")})
    proxy = _manifest_container("Deployment", "lynx-proxy")
    proxy = {**proxy, "args": [a.replace("http://lynx-prefill-0.lynx-prefill:8000", p.url)
                               .replace("http://lynx-decode-0.lynx-decode:8000", d.url) for a in proxy["args"]]}
    x = Server("proxy", _image_command(proxy, variables, x_port), x_port, tmp_path / "proxy.log", env=image_env)
    with _servers(p, d, x):
        _wait_healthy([p, d, x])
        out = _complete(x.url, model)
        assert out["choices"][0]["text"].strip(), out
        _assert_d_pulled(d.url)
        for s in (p, d):
            _assert_lynx_memory_default(s.log_path.read_text(errors="replace"), servers=1)
        # the speculative preset's scheduler runs on D only: P (kv_producer) keeps vLLM's scheduler and its
        # prefix cache
        p_log, d_log = (s.log_path.read_text(errors="replace") for s in (p, d))
        assert "LynxSpecScheduler" in d_log and "LynxSpecScheduler" not in p_log
        assert "custom_class" not in p_log and "disabling prefix caching" not in p_log


def test_launcher_command_line_for_real(model: str, tmp_path: Path) -> None:
    """``python -m lynx_connector.lab.launch MODEL``: up, one request through its proxy, D pulled; SIGTERM
    tears the deployment down and exits 0."""
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "lynx_connector.lab.launch", model, "--log-dir",
                             str(tmp_path / "logs")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out: list[str] = []
    try:
        deadline = time.monotonic() + STARTUP_S + 60
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            out.append(line)
            m = re.match(r"proxy at (http://\S+);", line)
            if m:
                url = m.group(1)
                break
            assert time.monotonic() < deadline, "".join(out)
        assert url, "".join(out)
        answer = _complete(url, model)
        assert answer["choices"][0]["text"].strip(), answer
        logs = tmp_path / "logs"
        for role in ("prefill", "decode"):
            _assert_lynx_memory_default((logs / f"{role}.log").read_text(errors="replace"), servers=2)
        text = "".join(out)
        started = {name: (u, int(pid))
                   for name, u, pid in re.findall(r"^(\w+) at (http://\S+) \(pid (\d+),", text, re.M)}
        assert set(started) == {"prefill", "decode", "proxy"}, text
        _assert_d_pulled(started["decode"][0])
        groups = [pid for _, pid in started.values()]
        pids = [proc.pid, *(p for g in groups for p in _pids_in_group(g))]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        _assert_gone(pids)
    finally:  # on a failure too: the launcher tears its servers down on SIGTERM; whatever is left is killed
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        _kill_leftover_groups([int(p) for p in re.findall(r"^\w+ at http://\S+ \(pid (\d+),", "".join(out), re.M)])
