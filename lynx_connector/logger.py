"""The library's logger: vLLM's logger tree when vLLM is importable (so VLLM_LOGGING_LEVEL and its format apply),
the standard library's otherwise (codec and transport work without vLLM). Use lazy ``%s`` arguments."""

from __future__ import annotations

import logging


def init_logger(name: str) -> logging.Logger:
    try:
        from vllm.logger import init_logger as _vllm_init_logger
    except Exception:  # vLLM absent or broken: the codec and transport still log
        return logging.getLogger(name)
    # vLLM configures handlers and its format on the "vllm" logger tree only: log under it so our lines
    # appear like vLLM's own and follow VLLM_LOGGING_LEVEL.
    return _vllm_init_logger(name if name.startswith("vllm.") else f"vllm.{name}")
