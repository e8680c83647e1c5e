"""Presets, the vLLM plugin (registration, entry point) and the --kv-transfer-config hook on vLLM's real
serve parser. No model, no engine: the parser is built in-process."""

from __future__ import annotations

import argparse
import json
import logging
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from lynx_connector.presets import (
    CONNECTOR_NAME,
    PRESET_MODES,
    PresetError,
    expand_kv_transfer_config,
    preset_config,
    preset_names,
)

# An existing local directory: with HF_HUB_OFFLINE=1 vLLM resolves a model id to a path while parsing.
MODEL_DIR = str(Path(__file__).resolve().parent)

# ---------------------------------------------------------------- presets (pure, no vLLM)


def test_expand_plain_preset() -> None:
    cfg = json.loads(expand_kv_transfer_config("lynx") or "")
    assert cfg == {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_connector.connector",
                   "kv_role": "kv_both", "kv_connector_extra_config": {"mode": "full"}}


@pytest.mark.parametrize("mode", PRESET_MODES)
def test_expand_every_mode(mode: str) -> None:
    cfg = json.loads(expand_kv_transfer_config(f"lynx:{mode}") or "")
    assert cfg["kv_connector"] == CONNECTOR_NAME and cfg["kv_connector_extra_config"] == {"mode": mode}


def test_expand_is_case_and_space_insensitive() -> None:
    assert json.loads(expand_kv_transfer_config("  LYNX:Int8 ") or "")["kv_connector_extra_config"] == {
        "mode": "int8"}


@pytest.mark.parametrize("bad", ["lynx:int3", "lynx:", "Lynx:FULLL"])
def test_unknown_preset_is_a_clear_error(bad: str) -> None:
    with pytest.raises(PresetError) as e:
        expand_kv_transfer_config(bad)
    message = str(e.value)
    assert bad.strip() in message and "lynx:int8" in message  # names the bad value and the valid ones


@pytest.mark.parametrize("value", [
    '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
    '{"kv_connector":"LynxConnector","kv_role":"kv_producer","kv_connector_extra_config":{"mode":"int8"}}',
    '{"kv_connector":"lynxish","kv_role":"kv_both"}',
    "{not json but mentions lynx",
    "NixlConnector",
    "",
    "lynxconnector",
])
def test_non_presets_pass_through(value: str) -> None:
    assert expand_kv_transfer_config(value) is None


def test_json_naming_a_preset_merges_overrides() -> None:
    value = json.dumps({"kv_connector": "lynx:anchor", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"link_gbps": 10}})
    cfg = json.loads(expand_kv_transfer_config(value) or "")
    assert cfg["kv_connector"] == CONNECTOR_NAME and cfg["kv_role"] == "kv_both"
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_extra_config"] == {"mode": "anchor", "link_gbps": 10}


def test_a_null_section_keeps_the_presets_and_a_contradicting_mode_is_an_error() -> None:
    value = json.dumps({"kv_connector": "lynx:speculative", "kv_connector_extra_config": None})
    assert json.loads(expand_kv_transfer_config(value) or "")["kv_connector_extra_config"] == {"mode": "speculative"}
    with pytest.raises(PresetError, match="'lynx:int8' names mode 'int8'.*sets mode 'int4'"):
        expand_kv_transfer_config(json.dumps({"kv_connector": "lynx:int8",
                                              "kv_connector_extra_config": {"mode": "int4"}}))
    same = json.dumps({"kv_connector": "lynx:int8", "kv_connector_extra_config": {"mode": " INT8"}})
    assert json.loads(expand_kv_transfer_config(same) or "")["kv_connector_extra_config"]["mode"] == " INT8"
    plain = json.dumps({"kv_connector": "lynx", "kv_connector_extra_config": {"mode": "int4"}})
    assert json.loads(expand_kv_transfer_config(plain) or "")["kv_connector_extra_config"] == {"mode": "int4"}


def test_preset_config_is_a_fresh_copy() -> None:
    a = preset_config("full")
    a["kv_connector_extra_config"]["mode"] = "int4"
    assert preset_config("full")["kv_connector_extra_config"]["mode"] == "full"
    assert preset_names()[0] == "lynx"


# ---------------------------------------------------------------- plugin registration


def test_entry_point_is_visible() -> None:
    eps = entry_points(group="vllm.general_plugins")
    assert any(ep.name == "lynx" and ep.value == "lynx_connector.plugin:register" for ep in eps)
    (ep,) = [ep for ep in eps if ep.name == "lynx"]
    from lynx_connector.plugin import register

    assert ep.load() is register


def test_register_is_idempotent() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from lynx_connector.plugin import register, register_connector

    register()
    register()
    assert CONNECTOR_NAME in KVConnectorFactory._registry
    assert register_connector() is False  # already there: no ValueError from the factory


def test_every_preset_is_a_valid_kv_transfer_config() -> None:
    from vllm.config import KVTransferConfig

    for mode in PRESET_MODES:
        cfg = KVTransferConfig(**preset_config(mode))
        assert cfg.kv_role == "kv_both" and cfg.is_kv_producer and cfg.is_kv_consumer


# ---------------------------------------------------------------- the hook on vLLM's real serve parser


@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    from lynx_connector.plugin import register

    register()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def _kv(parser: argparse.ArgumentParser, *argv: str) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parser.parse_args([MODEL_DIR, "--model", MODEL_DIR, *argv])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    return engine_args.kv_transfer_config


def test_hook_expands_preset(serve_parser: argparse.ArgumentParser) -> None:
    from vllm.config import KVTransferConfig

    kv = _kv(serve_parser, "--kv-transfer-config", "lynx")
    assert isinstance(kv, KVTransferConfig)
    assert kv.kv_connector == CONNECTOR_NAME and kv.kv_role == "kv_both"
    assert kv.kv_connector_module_path == "lynx_connector.connector"
    assert kv.kv_connector_extra_config == {"mode": "full"}
    assert _kv(serve_parser, "--kv-transfer-config=lynx:int8").kv_connector_extra_config == {"mode": "int8"}


def test_hook_keeps_json_and_dotted_keys(serve_parser: argparse.ArgumentParser) -> None:
    kv = _kv(serve_parser, "--kv-transfer-config",
             '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu"}')
    assert kv.kv_connector == "NixlConnector" and kv.kv_role == "kv_consumer"
    kv = _kv(serve_parser, "--kv-transfer-config.kv_connector", "LynxConnector",
             "--kv-transfer-config.kv_role", "kv_both",
             "--kv-transfer-config.kv_connector_extra_config.mode", "int4")
    assert kv.kv_connector == CONNECTOR_NAME and kv.kv_connector_extra_config == {"mode": "int4"}
    assert kv.kv_connector_module_path is None  # untouched: no preset named
    # dotted keys naming a preset: preset as the base, the keys override it
    kv = _kv(serve_parser, "--kv-transfer-config.kv_connector", "lynx:anchor",
             "--kv-transfer-config.kv_connector_extra_config.link_gbps", "10")
    assert kv.kv_connector == CONNECTOR_NAME and kv.kv_role == "kv_both"
    assert kv.kv_connector_extra_config == {"mode": "anchor", "link_gbps": 10}
    assert _kv(serve_parser) is None  # no flag: no connector


def test_hook_merges_dotted_keys_over_a_preset_and_reads_human_numbers(serve_parser: argparse.ArgumentParser) -> None:
    """A preset and dotted keys together: vLLM's parser makes the dotted keys a second, later JSON that replaced
    the preset whole (a server with no KV connector, silently); it is merged over the preset instead. vLLM's
    human-readable numbers (``2M``) work in a JSON naming a preset as in any other."""
    kv = _kv(serve_parser, "--kv-transfer-config", "lynx:int8",
             "--kv-transfer-config.kv_connector_extra_config.link_gbps", "10")
    assert kv.kv_connector == CONNECTOR_NAME and kv.kv_role == "kv_both"
    assert kv.kv_connector_extra_config == {"mode": "int8", "link_gbps": 10}
    with pytest.raises(SystemExit):  # a mode contradicting lynx:int8, as in the one-JSON form
        _kv(serve_parser, "--kv-transfer-config", "lynx:int8", "--kv-transfer-config.kv_connector_extra_config.mode",
            "int4")
    plain = _kv(serve_parser, "--kv-transfer-config", "lynx", "--kv-transfer-config.kv_connector_extra_config.mode",
                "int4")
    assert plain.kv_connector_extra_config == {"mode": "int4"}
    kv = _kv(serve_parser, "--kv-transfer-config", '{"kv_connector": "lynx:int8", '
             '"kv_connector_extra_config": {"chunk_bytes": 2M}}')
    assert kv.kv_connector == CONNECTOR_NAME and kv.kv_connector_extra_config == {"mode": "int8",
                                                                                   "chunk_bytes": 2 << 20}
    # a later JSON naming a connector still replaces the preset (vLLM's rule); the next parse starts afresh
    kv = _kv(serve_parser, "--kv-transfer-config", "lynx", "--kv-transfer-config",
             '{"kv_connector":"NixlConnector","kv_role":"kv_both"}')
    assert kv.kv_connector == "NixlConnector"
    assert _kv(serve_parser, "--kv-transfer-config", '{"kv_role":"kv_both","kv_connector":"X"}').kv_connector == "X"


def test_hook_with_config_file(serve_parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    short = tmp_path / "short.yaml"
    short.write_text("kv-transfer-config: lynx:bf16\n")
    assert _kv(serve_parser, "--config", str(short)).kv_connector_extra_config == {"mode": "bf16"}
    nested = tmp_path / "nested.yaml"
    nested.write_text("kv-transfer-config:\n  kv_connector: lynx\n  kv_load_failure_policy: recompute\n")
    kv = _kv(serve_parser, "--config", str(nested))
    assert kv.kv_connector == CONNECTOR_NAME and kv.kv_load_failure_policy == "recompute"


def test_hook_bad_preset_is_a_parser_error(serve_parser: argparse.ArgumentParser,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        serve_parser.parse_args([MODEL_DIR, "--kv-transfer-config", "lynx:int3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown Lynx preset 'lynx:int3'" in err and "lynx:int8" in err


def test_hook_missing_hook_point_only_warns(monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from lynx_connector import plugin

    monkeypatch.delattr(EngineArgs, "add_cli_args")
    caplog.set_level(logging.WARNING)
    plugin.logger.addHandler(caplog.handler)
    try:
        assert plugin.install_preset_hook() is False
        plugin.register()  # still no exception
    finally:
        plugin.logger.removeHandler(caplog.handler)
    assert "presets disabled" in caplog.text
    assert plugin.patch_parser(argparse.ArgumentParser()) is False


def test_a_prefill_only_pod_of_a_speculative_preset_gets_no_speculative_scheduler(
        serve_parser: argparse.ArgumentParser) -> None:
    """`lynx serve MODEL --kv-transfer-config lynx:speculative` installs the Lynx scheduler and null proposer; with
    `--kv-transfer-config.kv_role kv_producer` (a prefill pod: README) it does not, so P keeps vLLM's scheduler,
    its prefix cache and async scheduling, and still runs the preset's mode."""
    def parse(*argv: str) -> argparse.Namespace:
        return serve_parser.parse_args([MODEL_DIR, "--model", MODEL_DIR, *argv])

    d = parse("--kv-transfer-config", "lynx:speculative")
    assert d.scheduler_cls and d.scheduler_cls.endswith("LynxSpecScheduler") and d.speculative_config
    p = parse("--kv-transfer-config", "lynx:speculative", "--kv-transfer-config.kv_role", "kv_producer")
    assert p.scheduler_cls is None and p.speculative_config is None
    kv = _kv(serve_parser, "--kv-transfer-config", "lynx:speculative", "--kv-transfer-config.kv_role", "kv_producer")
    assert kv.kv_role == "kv_producer" and kv.kv_connector_extra_config == {"mode": "speculative"}
