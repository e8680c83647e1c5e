"""Real vLLM engines in child processes for the integration tests: a prefill engine (P), a decode engine (D)
and a plain local engine, each ``lynx_connector.lab.engine.EngineProcess`` (the harness the accuracy benchmark
uses too). P and D run the real LynxConnector and exchange KV over real NIXL between the two processes.
``SpecEngine`` is the decode engine of the speculative tests: the same, with the test hooks switched on, and
``call("tests.integration.spec_probes:...")`` runs probes next to the engine."""

from __future__ import annotations

from typing import Any

from lynx_connector.lab.engine import ENGINE_ENV, EngineProcess

__all__ = ["ENGINE_ENV", "SPEC_ENV", "EngineProcess", "SpecEngine", "aligned_prompt", "lynx_kv_config"]

#: ``kv_transfer_params["lynx_test_hooks"]`` is honoured only with this in the engine's environment.
SPEC_ENV = {"LYNX_TEST_HOOKS": "1"}


def lynx_kv_config(mode: str = "full", **extra: Any) -> dict[str, Any]:
    # the tests compare modes on one P/D pair, lossy ones included: allowed explicitly (the production default,
    # full precision only, is what tests/integration/test_signed_params.py runs with)
    cfg = {"mode": mode, "staging_mb": 256, "timeout_s": 20, "lease_s": 60, "allowed_modes": "all"}
    cfg.update(extra)
    return {
        "kv_connector": "LynxConnector",
        "kv_connector_module_path": "lynx_connector.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": cfg,
    }


def aligned_prompt(ids: list[int], block: int = 32) -> list[int]:
    """Drop a few haystack tokens so that len(ids) == k*block + 1 (keeps the chat header and the question): a
    local engine's second run of such a prompt computes its last token alone on its prefix cache, as D does after
    loading the first k*block, so the two runs' logprobs can be compared bit for bit."""
    drop = (len(ids) - 1) % block
    return ids[:3] + ids[3 + drop:]


class SpecEngine(EngineProcess):
    """An ``EngineProcess`` with ``LYNX_TEST_HOOKS=1`` (for the speculative mode tests)."""

    def __init__(self, model: str, kv_transfer_config: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(model, kv_transfer_config, env=SPEC_ENV, **kwargs)
