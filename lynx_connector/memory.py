"""Memory defaults of ``lynx serve``: the one place P and D get memory settings that let them share a machine.

vLLM's defaults assume one server owns the device. On a GPU each server takes ``--gpu-memory-utilization``
0.9 of the device, so a second server on it cannot start. On the CPU backend each server reserves 0.92 of the
machine's memory and refuses to start when less than that is free (``ValueError: Available memory on node 0
... is less than desired CPU memory utilization``): a second server, or any machine with something else
running, hits that.

When the command line and the environment choose nothing, ``lynx serve`` adds:

* CPU backend: ``--kv-cache-memory-bytes`` = :data:`CPU_KV_FRACTION` of the machine's memory (the cgroup
  limit when lower, e.g. in a container) divided by the servers sharing it, in whole GiB, at least 1 GiB;
* CUDA/ROCm, only when ``N`` > 1 servers share the GPU: ``--gpu-memory-utilization`` =
  :data:`GPU_SHARED_FRACTION` / ``N``, rounded down to 0.01 (0.42 each for P and D on one GPU).

``N`` is ``LYNX_SERVERS_PER_DEVICE`` (:data:`SERVERS_ENV`, default 1): the number of vLLM servers on this
machine's memory (CPU) or on this GPU. The lab's launcher (and so examples/1p1d/run_1p1d.sh) sets 2.

A choice of the user is never overridden: ``--kv-cache-memory-bytes``, ``--gpu-memory-utilization`` (or its
alias ``--device-memory-utilization``), on the command line or in a ``--config`` YAML file, each also spelled as an
abbreviation vLLM's parser accepts (``--kv-cache-mem 4G``, ``gpu-memory-util: 0.5``), or ``VLLM_CPU_KVCACHE_SPACE``
(CPU backend) add nothing. An abbreviation must be recognised, not merely come last: vLLM puts a ``--config``
file's options right after the model, before the defaults, and ``--kv-cache-memory-bytes`` overrides a
utilization whatever the order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

SERVERS_ENV = "LYNX_SERVERS_PER_DEVICE"
#: Share of the machine's memory given to KV caches on the CPU backend (all servers on it together).
CPU_KV_FRACTION = 0.10
#: Share of one GPU given to the servers that share it (all together; vLLM's own default for one is 0.9).
GPU_SHARED_FRACTION = 0.85
GiB = 1 << 30

#: Options by which the user chooses the memory (vLLM's spellings; ``_`` is accepted for ``-`` like vLLM does).
USER_OPTIONS = ("kv-cache-memory-bytes", "gpu-memory-utilization", "device-memory-utilization")
CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


class MemoryConfigError(ValueError):
    """An invalid ``LYNX_SERVERS_PER_DEVICE``."""


def servers_per_device(environ: Mapping[str, str]) -> int:
    text = environ.get(SERVERS_ENV, "").strip()
    if not text:
        return 1
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise MemoryConfigError(f"{SERVERS_ENV}={text!r}: expected a whole number >= 1 (the vLLM servers sharing "
                                "this machine's memory or this GPU)")
    return n


def _option_name(arg: str) -> str | None:
    if not arg.startswith("--"):
        return None
    return arg[2:].split("=", 1)[0].replace("_", "-")


def _config_file_keys(argv: Sequence[str]) -> set[str]:
    """Keys of the ``--config`` YAML file(s) in ``argv`` (vLLM turns them into options); unreadable files are
    left to vLLM to report."""
    keys: set[str] = set()
    for i, arg in enumerate(argv):
        path = None
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        if path is None:
            continue
        try:
            import yaml

            data = yaml.safe_load(Path(path).read_text())
        except Exception:  # vLLM reads the file itself and reports what is wrong with it
            continue
        if isinstance(data, dict):
            keys |= {str(k).replace("_", "-") for k in data}
    return keys


def _is_memory_option(name: str | None) -> bool:
    """``name`` (without ``--``, ``_`` as ``-``) is one of :data:`USER_OPTIONS` or a prefix of one: argparse's
    abbreviation of it (vLLM's parser allows them; a prefix that is ambiguous there is vLLM's error, and none of
    these prefixes is another option's full name: tests/test_memory.py checks both against the installed vLLM)."""
    return bool(name) and len(name) >= 2 and any(opt.startswith(name) for opt in USER_OPTIONS)


def user_chose_memory(argv: Sequence[str], environ: Mapping[str, str], device: str) -> str | None:
    """What in ``argv``/``environ`` already sets the memory (for the log), or None."""
    for arg in argv:
        name = _option_name(arg)
        if _is_memory_option(name):
            return "--" + str(name)
    in_file = sorted(k for k in _config_file_keys(argv) if _is_memory_option(k))
    if in_file:
        return f"{in_file[0]} in --config"
    if device == "cpu" and environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip():
        return "VLLM_CPU_KVCACHE_SPACE"
    return None


def cpu_kv_cache_bytes(total_bytes: int, servers: int) -> int:
    """KV cache of one server on the CPU backend: ``CPU_KV_FRACTION`` of ``total_bytes`` / ``servers``, whole
    GiB, at least 1 GiB."""
    return max(1, math.floor(total_bytes * CPU_KV_FRACTION / servers / GiB)) * GiB


def gpu_memory_utilization(servers: int) -> float | None:
    """``--gpu-memory-utilization`` of one of ``servers`` sharing a GPU; None for one (vLLM's default)."""
    if servers <= 1:
        return None
    util = math.floor(GPU_SHARED_FRACTION / servers * 100) / 100
    if util < 0.01:  # vLLM refuses 0
        raise MemoryConfigError(f"{SERVERS_ENV}={servers}: {GPU_SHARED_FRACTION} of the GPU shared by {servers} "
                                "servers is less than 0.01 each; set --gpu-memory-utilization yourself")
    return util


def memory_args(argv: Sequence[str], environ: Mapping[str, str], *, device: str, total_bytes: int) -> list[str]:
    """The options ``lynx serve`` adds for ``device`` (``cpu``, ``cuda`` or anything else: nothing), given the
    machine's memory ``total_bytes`` (CPU); [] when the user chose."""
    if device not in ("cpu", "cuda"):
        return []
    if user_chose_memory(argv, environ, device) is not None:
        return []
    n = servers_per_device(environ)  # read only when used: a bad value beside the user's own choice is no error
    if device == "cpu":
        return ["--kv-cache-memory-bytes", str(cpu_kv_cache_bytes(total_bytes, n))]
    util = gpu_memory_utilization(n)
    return [] if util is None else ["--gpu-memory-utilization", f"{util:.2f}"]


def machine_memory_bytes(limit_files: Sequence[str] = CGROUP_LIMIT_FILES) -> int:
    """The machine's memory, or this process's cgroup memory limit when lower (a container)."""
    import psutil

    total = int(psutil.virtual_memory().total)
    for path in limit_files:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def available_memory_bytes(cgroup_dir: str = "/sys/fs/cgroup") -> int:
    """Memory this process can still take: the machine's available memory, or what is left under its cgroup v2
    limit when that is less (a container). The cgroup's usage counts its working set, as kubelet does: its
    inactive page cache (e.g. the weights just read) is reclaimed at the limit, so it is not in use."""
    import psutil

    available = int(psutil.virtual_memory().available)
    try:
        limit = Path(cgroup_dir, "memory.max").read_text().strip()
        current = Path(cgroup_dir, "memory.current").read_text().strip()
    except OSError:
        return available
    if limit.isdigit() and current.isdigit():
        used = int(current) - _inactive_file_bytes(Path(cgroup_dir, "memory.stat"))
        available = min(available, max(0, int(limit) - max(used, 0)))
    return available


def _inactive_file_bytes(stat: Path) -> int:
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "inactive_file" and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def check_staging_memory(staging_mb: int, pools: int, role: str, available: int | None = None) -> None:
    """Start-up: the worker's staging pools (``pools`` of ``staging_mb`` MiB, written at once, so resident) must fit
    the memory still available, or the allocation fails with a bare torch error or the OOM killer ends the
    engine. Raises ``LynxConfigError`` naming ``staging_mb``."""
    from lynx_connector.config import LynxConfigError

    need = pools * (staging_mb << 20)
    free = available_memory_bytes() if available is None else available
    if need > free:
        two = (" (kv_role kv_both holds a pool to send and one to receive: kv_producer on prefill instances and "
               "kv_consumer on decode instances hold one)" if pools > 1 else "")
        raise LynxConfigError(f"staging_mb: {pools} staging pool(s) of {staging_mb} MiB{two} need {need >> 20} MiB, "
                              f"but only {free >> 20} MiB of memory is available to this {role} worker; lower "
                              "staging_mb or free memory")


def current_device() -> str:
    """``cpu`` or ``cuda`` (CUDA and ROCm) for vLLM's current platform, else its device type."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda_alike():
        return "cuda"
    return str(current_platform.device_type)


def with_memory_defaults(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """``vllm serve`` arguments with the options of :func:`memory_args` inserted before the user's options (after
    the model, when it comes first); nothing when the user chose (:func:`user_chose_memory`, abbreviations
    included). (Nothing is logged
    here: vLLM configures logging only after parsing; its ``non-default args`` line shows what was added, e.g.
    ``'kv_cache_memory_bytes': 2147483648``.)"""
    env = os.environ if environ is None else environ
    device = current_device()
    added = memory_args(argv, env, device=device, total_bytes=machine_memory_bytes() if device == "cpu" else 0)
    at = 1 if argv and not argv[0].startswith("-") else 0
    return [*argv[:at], *added, *argv[at:]]
