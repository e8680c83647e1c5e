"""``--kv-transfer-config`` presets: short names that expand into the full KVTransferConfig JSON.

Pure data and string handling, no vLLM import at module level, so it is unit-testable anywhere. ``plugin.py`` wires
:func:`expand_kv_transfer_config` in front of vLLM's own parser for ``--kv-transfer-config``.

Accepted forms (case-insensitive, surrounding whitespace ignored):

* ``lynx``                      -> LynxConnector, mode ``full``
* ``lynx:<mode>``               -> LynxConnector with that mode, any mode of the table in
                                   ``lynx_connector/modes.py`` (:data:`PRESET_MODES`), or ``auto``
                                   (``speculative`` and ``auto`` also get the Lynx scheduler and a null
                                   proposer, see :func:`speculative_defaults`)
* JSON whose ``kv_connector`` is one of the names above, e.g. what dotted keys produce::

      --kv-transfer-config.kv_connector lynx:int8 \\
      --kv-transfer-config.kv_connector_extra_config.link_gbps 10

  The preset is the base and every key given in the JSON overrides it (nested dicts merged).

Anything else (ordinary JSON, other connectors, unparsable text) is not a preset: the function returns
``None`` and vLLM parses the value unchanged.

Every preset uses ``kv_role="kv_both"``: one config serves P and D pods; the per-request role comes from
``kv_transfer_params`` sent by the proxy (``do_remote_decode`` on P, ``do_remote_prefill`` on D). A prefill pod of
a speculative preset (``lynx:speculative``, ``lynx:auto``) should say ``"kv_role": "kv_producer"`` over it: it then
runs vLLM's own scheduler (keeping its prefix cache and async scheduling) and still signs the preset's mode.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from lynx_connector.modes import DEFAULT_MODE, get_mode, preset_modes

PRESET_PREFIX = "lynx"
CONNECTOR_NAME = "LynxConnector"
CONNECTOR_MODULE = "lynx_connector.connector"
#: vLLM's kv_role of an instance that only prefills: no speculative scheduler (``speculative_defaults``).
PREFILL_ONLY_ROLE = "kv_producer"

#: Every transfer mode is a preset (the modes table decides; ``lynx:int4_kivi`` included).
PRESET_MODES: tuple[str, ...] = preset_modes()

#: What a speculative-mode instance needs besides the connector (lynx_connector/speculative/).
SPEC_SCHEDULER = "lynx_connector.speculative.scheduler.LynxSpecScheduler"
NULL_PROPOSER = "lynx_connector.speculative.proposer.NullProposer"
DEFAULT_MAX_SPECULATIVE_TOKENS = 64
MAX_SPEC_LEN = 128  # vLLM's RejectionSampler limit on drafts per step


class PresetError(ValueError):
    """A value that names a Lynx preset but is not a valid one (e.g. ``lynx:int3``)."""


def preset_names() -> list[str]:
    """All accepted preset spellings, for help texts and error messages."""
    return [PRESET_PREFIX] + [f"{PRESET_PREFIX}:{mode}" for mode in PRESET_MODES]


def preset_config(mode: str = DEFAULT_MODE) -> dict[str, Any]:
    """The full KVTransferConfig dict for one mode (a fresh copy each call)."""
    if mode not in PRESET_MODES:
        raise PresetError(
            f"unknown Lynx preset mode {mode!r}; valid presets: {', '.join(preset_names())}"
        )
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"mode": mode},
    }


def _preset_mode(name: str) -> str | None:
    """Mode named by a preset string, None when ``name`` is not a Lynx preset, PresetError when it is
    a malformed one."""
    text = name.strip().lower()
    if text == PRESET_PREFIX:
        return DEFAULT_MODE
    if not text.startswith(PRESET_PREFIX + ":"):
        return None
    mode = text[len(PRESET_PREFIX) + 1 :].strip()
    if mode not in PRESET_MODES:
        raise PresetError(
            f"unknown Lynx preset {name.strip()!r}; valid presets: {', '.join(preset_names())}"
        )
    return mode


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def expand_preset_dict(config: dict[str, Any]) -> dict[str, Any] | None:
    """Expand a config dict whose ``kv_connector`` names a preset; None when it does not."""
    connector = config.get("kv_connector")
    if not isinstance(connector, str):
        return None
    mode = _preset_mode(connector)
    if mode is None:
        return None
    base = preset_config(mode)
    # null for a section the preset fills (``kv_connector_extra_config: null``) means "nothing to add"
    overrides = {k: v for k, v in config.items()
                 if k != "kv_connector" and not (v is None and isinstance(base.get(k), dict))}
    extra = overrides.get("kv_connector_extra_config")
    if ":" in connector and isinstance(extra, dict) and "mode" in extra \
            and str(extra["mode"]).strip().lower() != mode:
        raise PresetError(f"the preset {connector.strip()!r} names mode {mode!r} but kv_connector_extra_config sets "
                          f"mode {extra['mode']!r}: give one of them (the plain preset {PRESET_PREFIX!r} takes any "
                          "mode from the extra config)")
    return _deep_merge(base, overrides)


def preset_request(value: str) -> dict[str, Any]:
    """A ``--kv-transfer-config`` value that names a preset, as a config dict: ``lynx:int8`` is
    ``{"kv_connector": "lynx:int8"}``, a JSON is itself."""
    text = value.strip()
    return json.loads(text) if text.startswith("{") else {"kv_connector": text}


def merge_over_preset(preset: dict[str, Any], value: str) -> str | None:
    """``value`` (a ``--kv-transfer-config`` JSON) merged over ``preset`` (:func:`preset_request` of a value that
    named a preset) and expanded as one preset config, when it names no connector (what vLLM's parser makes of
    dotted keys such as ``--kv-transfer-config.kv_connector_extra_config.link_gbps 10``); None when it names one or
    is no JSON object (it then replaces the preset, as vLLM does)."""
    try:
        parsed = json.loads(value)
    except (TypeError, json.JSONDecodeError):
        return None
    if not isinstance(parsed, dict) or "kv_connector" in parsed:
        return None
    return json.dumps(expand_preset_dict(_deep_merge(preset, parsed)))


def expand_kv_transfer_config(value: str) -> str | None:
    """Expanded JSON for a preset value of ``--kv-transfer-config``; None when ``value`` is no preset.

    Raises :class:`PresetError` for a malformed preset such as ``lynx:int3``.
    """
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text.startswith("{"):
        mode = _preset_mode(text)
        return None if mode is None else json.dumps(preset_config(mode))
    if PRESET_PREFIX not in text.lower():  # cheap exit for every ordinary JSON config
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None  # leave it to vLLM (it also accepts human-readable numbers such as 1k)
    if not isinstance(parsed, dict):
        return None
    expanded = expand_preset_dict(parsed)
    return None if expanded is None else json.dumps(expanded)


def speculative_defaults(kv_config: Any) -> dict[str, Any] | None:
    """Engine settings a decode instance needs for a mode that needs the speculative scheduler (the modes
    table: ``speculative``), or None when ``kv_config`` (a dict or a parsed KVTransferConfig) is not a
    LynxConnector config in such a mode.

    ``scheduler_cls``: the Lynx scheduler (holds anchor-phase tokens, rewinds and verifies);
    ``speculative_config``: a ``custom_class`` null proposer with ``num_speculative_tokens`` = the speculation
    cap (``max_speculative_tokens``, so all held tokens are verified in one pass; at most 128).

    None too for a prefill-only instance (``kv_role`` ``kv_producer``): it decodes nothing, and the scheduler
    would cost it its prefix cache and vLLM's async scheduling."""
    get = kv_config.get if isinstance(kv_config, dict) else (lambda k, d=None: getattr(kv_config, k, d))
    if get("kv_connector") != CONNECTOR_NAME or get("kv_role") == PREFILL_ONLY_ROLE:
        return None
    extra = get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        return None
    from lynx_connector.config import LynxConfig, LynxConfigError  # parsed as the connector will parse it

    try:
        config = LynxConfig.from_extra_config(extra)
    except LynxConfigError:
        return None  # the connector reports the bad value itself, at start-up
    # auto: only the modes it may pick here (allowed_modes) count
    if not any(get_mode(m).needs_spec_scheduler for m in config.concrete_modes):
        return None
    return speculative_engine_args(max(1, min(config.max_speculative_tokens, MAX_SPEC_LEN)))


def speculative_engine_args(k: int = DEFAULT_MAX_SPECULATIVE_TOKENS) -> dict[str, Any]:
    """The engine arguments of a speculative-mode decode instance with ``k`` verification slots per pass:
    ``scheduler_cls`` (the Lynx scheduler) and ``speculative_config`` (the null proposer, ``k`` =
    ``num_speculative_tokens``). The one builder: the plugin's defaults, the benches and the tests use it."""
    if not 1 <= k <= MAX_SPEC_LEN:
        raise ValueError(f"num_speculative_tokens must be in 1..{MAX_SPEC_LEN}, got {k}")
    return {
        "scheduler_cls": SPEC_SCHEDULER,
        "speculative_config": {"method": "custom_class", "model": NULL_PROPOSER, "num_speculative_tokens": k},
    }


def engine_args(kv_transfer_config: str | dict[str, Any] = PRESET_PREFIX) -> dict[str, Any]:
    """The engine arguments of a Lynx instance for vLLM's offline API, what ``lynx serve`` makes of the same
    ``--kv-transfer-config`` (presets are a feature of vLLM's command-line parser, which ``LLM(...)`` does not run)::

        llm = LLM(model, **engine_args("lynx:speculative"))
        llm = LLM(model, **engine_args({"kv_connector": "lynx", "kv_connector_extra_config": {"mode": "int8"}}))

    ``kv_transfer_config``: a preset (``lynx``, ``lynx:<mode>``), or a config dict (or its JSON) whose
    ``kv_connector`` names a preset (its other keys override the preset's) or ``LynxConnector``. Returns
    ``kv_transfer_config`` (the full dict) and, when a mode it allows needs them, ``scheduler_cls`` and
    ``speculative_config`` (:func:`speculative_defaults`). :class:`PresetError` for anything else."""
    config = preset_request(kv_transfer_config) if isinstance(kv_transfer_config, str) else dict(kv_transfer_config)
    expanded = expand_preset_dict(config)
    if expanded is None:
        if config.get("kv_connector") != CONNECTOR_NAME:
            raise PresetError(f"kv_connector {config.get('kv_connector')!r} is neither {CONNECTOR_NAME!r} nor a "
                              f"Lynx preset ({', '.join(preset_names())})")
        expanded = {"kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both", **copy.deepcopy(config)}
    return {"kv_transfer_config": expanded, **(speculative_defaults(expanded) or {})}


def speculative_serve_args(k: int = DEFAULT_MAX_SPECULATIVE_TOKENS) -> list[str]:
    """:func:`speculative_engine_args` as ``lynx serve`` / ``vllm serve`` flags."""
    args = speculative_engine_args(k)
    return ["--scheduler-cls", args["scheduler_cls"], "--speculative-config", json.dumps(args["speculative_config"])]
