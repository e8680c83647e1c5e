"""vLLM general plugin (entry point ``vllm.general_plugins: lynx``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers) and again
from ``AsyncEngineArgs.add_cli_args`` right before ``EngineArgs.add_cli_args`` builds the CLI parser
(vllm/engine/arg_utils.py in 0.32). It must therefore be idempotent and must never raise.

It does three things:

1. registers ``LynxConnector`` with ``KVConnectorFactory`` (lazy: the connector module is imported only
   when a connector is created), so ``{"kv_connector": "LynxConnector"}`` works without
   ``kv_connector_module_path`` and ``get_connector_class_by_name`` finds it;
2. installs the ``--kv-transfer-config lynx`` preset (see :mod:`lynx_connector.presets`): it wraps
   ``EngineArgs.add_cli_args`` and, on each parser it builds, wraps the ``type`` callable of the
   ``--kv-transfer-config`` action so that a preset value is expanded to JSON before vLLM's own
   dataclass parser sees it. JSON values, dotted keys (FlexibleArgumentParser turns them into JSON)
   and ``--config file.yaml`` (turned into ordinary arguments) all go through the same callable; a JSON naming
   no connector that follows a preset in the same command line (dotted keys beside ``lynx:<mode>``) is merged
   over it, and vLLM's human-readable numbers (``2M``) are expanded before a JSON is read;
3. after parsing (a wrapper around the parser's ``parse_known_args``), when the KV transfer config is a
   LynxConnector config in ``speculative`` mode and the user set neither ``--scheduler-cls`` nor a
   speculative config (``--speculative-config`` or ``--spec-*``), fills both in with
   :func:`lynx_connector.presets.speculative_defaults` (the Lynx scheduler and a null proposer).

If a vLLM version lacks one of these hook points, a warning is logged and the rest keeps working.
"""

from __future__ import annotations

import argparse
import functools
import threading
from collections.abc import Callable
from typing import Any

from lynx_connector.logger import init_logger
from lynx_connector.presets import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    PresetError,
    expand_kv_transfer_config,
    merge_over_preset,
    preset_names,
    preset_request,
    speculative_defaults,
)

logger = init_logger(__name__)

KV_TRANSFER_OPTION = "--kv-transfer-config"
_WRAPPED_MARK = "_lynx_preset_wrapped"
#: The preset expanded so far in the parse under way (per thread): a later ``--kv-transfer-config`` JSON without
#: ``kv_connector`` is merged over it. vLLM's parser turns dotted keys into such a JSON, placed last, which would
#: otherwise replace the preset whole and leave the server with no KV connector at all.
_parse = threading.local()


def _human_numbers(value: str) -> str:
    """vLLM's expansion of ``80m``/``2M`` in JSON values (its parser applies it after ours): needed before our
    own ``json.loads``; the value unchanged where this vLLM has none."""
    try:
        from vllm.engine.arg_utils import _expand_json_human_readable_numbers
    except ImportError:
        return value
    return _expand_json_human_readable_numbers(value)


def register() -> None:
    """Entry point for ``vllm.general_plugins``; safe to call any number of times."""
    try:
        register_connector()
    except Exception:  # never break vLLM's start-up because of the plugin
        logger.warning("Lynx plugin: registering %s failed", CONNECTOR_NAME, exc_info=True)
    try:
        install_preset_hook()
    except Exception:
        logger.warning("Lynx plugin: installing the --kv-transfer-config preset failed", exc_info=True)
    try:
        from lynx_connector.vllm_fixes import install_guards

        install_guards()  # the speculative path's top-k and the rejection sampler on CPU (vllm_fixes.py)
    except Exception:
        logger.warning("Lynx plugin: installing the guards of vLLM's speculative sampling failed", exc_info=True)


def register_connector() -> bool:
    """Register LynxConnector with vLLM's factory; True when this call registered it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return False
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered meanwhile (the factory raises on duplicates)
        return False
    logger.debug("Lynx plugin: registered %s from %s", CONNECTOR_NAME, CONNECTOR_MODULE)
    return True


def install_preset_hook() -> bool:
    """Wrap ``EngineArgs.add_cli_args`` so every vLLM parser understands the presets.

    Returns True when the hook is in place (now or from an earlier call)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:
        logger.warning("Lynx plugin: vllm.engine.arg_utils.EngineArgs not importable; "
                       "--kv-transfer-config presets disabled (use JSON or dotted keys)")
        return False
    original = getattr(EngineArgs, "add_cli_args", None)
    if not callable(original):
        logger.warning("Lynx plugin: EngineArgs.add_cli_args not found in this vLLM; "
                       "--kv-transfer-config presets disabled (use JSON or dotted keys)")
        return False
    if getattr(original, _WRAPPED_MARK, False):
        return True

    @functools.wraps(original)
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(parser, *args, **kwargs)
        try:
            patch_parser(result if result is not None else parser)
        except Exception:
            logger.warning("Lynx plugin: could not patch %s; presets disabled", KV_TRANSFER_OPTION,
                           exc_info=True)
        return result

    setattr(add_cli_args, _WRAPPED_MARK, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)  # type: ignore[method-assign]
    return True


def _wrap_type(original: Callable[[str], Any] | None) -> Callable[[str], Any]:
    def parse_kv_transfer_config(value: str) -> Any:
        if isinstance(value, str) and value.strip().startswith("{"):
            value = _human_numbers(value)
        try:
            expanded = expand_kv_transfer_config(value)
        except PresetError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
        preset = getattr(_parse, "preset", None)
        if expanded is not None:
            logger.info("Lynx preset %r expanded to --kv-transfer-config %s", value, expanded)
            _parse.preset = preset_request(value)
            value = expanded
        elif preset is not None:
            try:
                merged = merge_over_preset(preset, value)
            except PresetError as e:
                raise argparse.ArgumentTypeError(str(e)) from e
            if merged is not None:
                logger.info("Lynx preset: --kv-transfer-config %s merged over the preset: %s", value, merged)
                value = merged
        return original(value) if original is not None else value

    setattr(parse_kv_transfer_config, _WRAPPED_MARK, True)
    return parse_kv_transfer_config


def apply_speculative_defaults(args: argparse.Namespace) -> bool:
    """Fill in ``scheduler_cls`` / ``speculative_config`` for a speculative-mode Lynx config when the user gave
    neither; True when it did. A user-given value is never overridden (a partial one is warned about)."""
    kv = getattr(args, "kv_transfer_config", None)
    defaults = speculative_defaults(kv) if kv is not None else None
    if defaults is None:
        return False
    user_sched = getattr(args, "scheduler_cls", None)
    user_spec = getattr(args, "speculative_config", None) or any(
        getattr(args, name, None) is not None for name in ("spec_method", "spec_model", "spec_tokens"))
    if user_sched is not None and user_spec:
        return False
    if user_sched is not None or user_spec:
        logger.warning("Lynx speculative mode: you set %s but not %s; leaving both as given (the Lynx scheduler "
                       "needs --scheduler-cls %s and a custom_class speculative config)",
                       "--scheduler-cls" if user_sched is not None else "a speculative config",
                       "a speculative config" if user_sched is not None else "--scheduler-cls",
                       defaults["scheduler_cls"])
        return False
    args.scheduler_cls = defaults["scheduler_cls"]
    args.speculative_config = defaults["speculative_config"]
    logger.info("Lynx speculative mode: --scheduler-cls %s --speculative-config %s", args.scheduler_cls,
                args.speculative_config)
    return True


def _wrap_parse(parser: argparse.ArgumentParser) -> None:
    original = parser.parse_known_args
    if getattr(original, _WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        outer = getattr(_parse, "preset", None)
        _parse.preset = None
        try:
            ns, rest = original(args, namespace)
        finally:
            _parse.preset = outer
        try:
            apply_speculative_defaults(ns)
        except Exception:
            logger.warning("Lynx plugin: could not apply the speculative-mode defaults", exc_info=True)
        return ns, rest

    setattr(parse_known_args, _WRAPPED_MARK, True)
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def patch_parser(parser: argparse.ArgumentParser) -> bool:
    """Wrap the ``type`` of the parser's ``--kv-transfer-config`` action and its ``parse_known_args``
    (idempotent)."""
    for action in getattr(parser, "_actions", []):
        if KV_TRANSFER_OPTION in getattr(action, "option_strings", ()):
            if not getattr(action.type, _WRAPPED_MARK, False):
                action.type = _wrap_type(action.type)
                if action.help and "lynx" not in action.help:
                    action.help += "\n\nLynx presets: " + ", ".join(preset_names())
            _wrap_parse(parser)
            return True
    logger.warning("Lynx plugin: no %s option on this parser; presets disabled", KV_TRANSFER_OPTION)
    return False
