"""The lynx:speculative preset configures the decode instance for speculation on vLLM's real serve parser:
scheduler class and a custom_class null proposer, unless the user gave their own."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from lynx_connector.presets import (
    NULL_PROPOSER,
    SPEC_SCHEDULER,
    preset_config,
    speculative_defaults,
    speculative_engine_args,
    speculative_serve_args,
)

# An existing local directory: with HF_HUB_OFFLINE=1 vLLM resolves a model id to a path while parsing.
MODEL_DIR = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    from lynx_connector.plugin import register

    register()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def _engine_args(parser: argparse.ArgumentParser, *argv: str) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(parser.parse_args([MODEL_DIR, "--model", MODEL_DIR, *argv]))


def test_defaults_only_for_speculative_lynx() -> None:
    assert speculative_defaults(preset_config("full")) is None
    assert speculative_defaults({"kv_connector": "NixlConnector"}) is None
    d = speculative_defaults(preset_config("speculative"))
    assert d == {"scheduler_cls": SPEC_SCHEDULER, "speculative_config": {
        "method": "custom_class", "model": NULL_PROPOSER, "num_speculative_tokens": 64}}
    cfg = preset_config("speculative")
    cfg["kv_connector_extra_config"]["max_speculative_tokens"] = 500
    assert speculative_defaults(cfg)["speculative_config"]["num_speculative_tokens"] == 128  # vLLM's limit


def test_defaults_read_the_extra_config_as_the_connector_does() -> None:
    """The engine's verification slots equal the connector's cap however it is spelled (``0x20`` is 32 for the
    connector; it was 64 here), and auto gets the scheduler only when it may pick speculative."""
    def k(extra: dict) -> int | None:
        d = speculative_defaults({**preset_config("speculative"), "kv_connector_extra_config": extra})
        return None if d is None else d["speculative_config"]["num_speculative_tokens"]

    assert k({"mode": "speculative", "max_speculative_tokens": "0x20"}) == 32
    assert k({"mode": "speculative", "max_speculative_tokens": "16"}) == 16
    assert k({"mode": "auto"}) == 64
    assert k({"mode": "auto", "allowed_modes": "auto,full,bf16"}) is None  # auto can never speculate here
    assert k({"mode": "full", "allowed_modes": "full,speculative"}) is None  # a request's lynx_mode: no scheduler
    assert k({"mode": "speculative", "max_speculative_tokens": "many"}) is None  # the connector refuses it


def test_one_builder_in_both_forms(serve_parser: argparse.ArgumentParser) -> None:
    """speculative_engine_args(k) is what the defaults, the benches and the tests start D with; its serve-flag
    form parses into the same engine arguments; the dotted paths name the real classes."""
    import importlib

    assert speculative_defaults(preset_config("speculative")) == speculative_engine_args()
    args = speculative_engine_args(8)
    assert args["speculative_config"]["num_speculative_tokens"] == 8
    ea = _engine_args(serve_parser, *speculative_serve_args(8))
    assert (ea.scheduler_cls, ea.speculative_config) == (args["scheduler_cls"], args["speculative_config"])
    for dotted, name in ((SPEC_SCHEDULER, "LynxSpecScheduler"), (NULL_PROPOSER, "NullProposer")):
        mod, cls = dotted.rsplit(".", 1)
        assert cls == name and getattr(importlib.import_module(mod), cls).__name__ == name
    for bad in (0, 129):
        with pytest.raises(ValueError):
            speculative_engine_args(bad)


def test_preset_sets_scheduler_and_proposer(serve_parser: argparse.ArgumentParser) -> None:
    ea = _engine_args(serve_parser, "--kv-transfer-config", "lynx:speculative")
    assert ea.scheduler_cls == SPEC_SCHEDULER
    assert ea.speculative_config == {"method": "custom_class", "model": NULL_PROPOSER, "num_speculative_tokens": 64}
    ea = _engine_args(serve_parser, "--kv-transfer-config.kv_connector", "lynx:speculative",
                      "--kv-transfer-config.kv_connector_extra_config.max_speculative_tokens", "16")
    assert ea.speculative_config["num_speculative_tokens"] == 16


def test_other_modes_and_connectors_untouched(serve_parser: argparse.ArgumentParser) -> None:
    from vllm.config import SchedulerConfig

    for argv in (("--kv-transfer-config", "lynx"), ("--kv-transfer-config", "lynx:anchor"), ()):
        ea = _engine_args(serve_parser, *argv)
        assert ea.speculative_config is None and ea.scheduler_cls == SchedulerConfig.scheduler_cls


def test_user_choices_win(serve_parser: argparse.ArgumentParser) -> None:
    mine = {"method": "custom_class", "model": NULL_PROPOSER, "num_speculative_tokens": 4}
    ea = _engine_args(serve_parser, "--kv-transfer-config", "lynx:speculative", "--scheduler-cls", "my.Sched",
                      "--speculative-config", json.dumps(mine))
    assert ea.scheduler_cls == "my.Sched" and ea.speculative_config == mine
    ea = _engine_args(serve_parser, "--kv-transfer-config", "lynx:speculative", "--scheduler-cls", SPEC_SCHEDULER)
    assert ea.speculative_config is None  # partial choice: left as given (and warned about)


def test_scheduler_class_resolves(serve_parser: argparse.ArgumentParser) -> None:
    """vLLM resolves the filled-in scheduler class the way it does at engine start."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from lynx_connector.speculative.scheduler import LynxSpecScheduler

    ea = _engine_args(serve_parser, "--kv-transfer-config", "lynx:speculative")
    assert resolve_obj_by_qualname(ea.scheduler_cls) is LynxSpecScheduler


@pytest.mark.parametrize("argv", [
    ("--kv-transfer-config", "lynx:speculative"),
    ("--kv-transfer-config", "lynx"),
    ("--kv-transfer-config", '{"kv_connector": "lynx:auto", "kv_connector_extra_config": {"link_gbps": 10}}'),
    ("--kv-transfer-config.kv_connector", "lynx:speculative",
     "--kv-transfer-config.kv_connector_extra_config.max_speculative_tokens", "16"),
])
def test_offline_engine_args_equal_what_the_cli_makes_of_the_preset(serve_parser: argparse.ArgumentParser,
                                                                    argv: tuple[str, ...]) -> None:
    """``presets.engine_args`` (for ``LLM(model, **engine_args(...))``, where vLLM's parser and so the presets do
    not run) gives the engine arguments ``vllm serve`` makes of the same preset: the expanded kv_transfer_config,
    and the speculative scheduler and proposer where the mode needs them."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from lynx_connector.presets import engine_args

    cli = _engine_args(serve_parser, *argv)
    if argv[0] == "--kv-transfer-config":
        value: Any = argv[1]
    else:  # the dotted keys as the dict a Python caller writes
        value = {"kv_connector": argv[1], "kv_connector_extra_config": {"max_speculative_tokens": 16}}
    offline = engine_args(value)
    kv = offline.pop("kv_transfer_config")
    ea = AsyncEngineArgs(model=MODEL_DIR, kv_transfer_config=KVTransferConfig(**kv), **offline)  # as LLM converts it
    ours, theirs = (dataclasses.asdict(c.kv_transfer_config) for c in (ea, cli))
    assert ours.pop("engine_id") and theirs.pop("engine_id")  # a fresh uuid each
    assert ours == theirs
    assert (ea.scheduler_cls, ea.speculative_config) == (cli.scheduler_cls, cli.speculative_config)


def test_offline_engine_args_of_a_connector_config_and_bad_values() -> None:
    from lynx_connector.presets import PresetError, engine_args

    plain = engine_args({"kv_connector": "LynxConnector", "kv_connector_extra_config": {"mode": "speculative"}})
    assert plain["kv_transfer_config"]["kv_role"] == "kv_both" and plain["scheduler_cls"] == SPEC_SCHEDULER
    assert set(engine_args("lynx:int8")) == {"kv_transfer_config"}
    for bad in ("NixlConnector", {"kv_connector": "NixlConnector"}, "lynx:int3"):
        with pytest.raises(PresetError):
            engine_args(bad)
