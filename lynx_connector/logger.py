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


def configure_process_logging() -> None:
    """For a process that starts no vLLM engine (``lynx proxy``): apply vLLM's logging configuration (its
    handler and format, VLLM_LOGGING_LEVEL, VLLM_LOGGING_CONFIG_PATH), which vLLM itself applies only when an
    engine starts; without it only warnings reach stderr, unformatted."""
    try:
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed
    except Exception:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
        return
    configure_logging_if_needed(LoggingConfig())
