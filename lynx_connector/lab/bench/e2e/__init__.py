"""``lynx bench e2e``: real 1P1D serving, every transfer mode over paced links (see ``cli`` for the method).

By concern: ``plan`` (modes, sizes, model shape, wire bytes, ideal TTFT, link rates: pure arithmetic),
``measure`` (Prometheus counters, requests, cells, rows), ``deploy`` (P + D + proxy through
``lynx_connector.lab.launch.Deployment``, D restarted per rate), ``targets`` (the checks) and ``cli``
(arguments and the run). ``add_parser`` and ``run`` are what ``lynx bench`` loads.
"""

from __future__ import annotations

from lynx_connector.lab.bench.e2e.cli import add_parser, main, run
from lynx_connector.lab.bench.e2e.deploy import speculative_serve_args, start_deployment
from lynx_connector.lab.bench.e2e.measure import (
    counter_delta,
    detect_speculative,
    equality_by_row,
    mark_output_equality,
    measure_prefill,
    merge_p_delta,
    run_rate,
    scrape_counters,
    summarize_cell,
)
from lynx_connector.lab.bench.e2e.plan import (
    CACHE_DTYPES,
    MODES,
    TASKS,
    ModelShape,
    Plan,
    build_prompts,
    choose_rates,
    ideal_ttfts,
    kv_config,
    model_shape,
    quantile,
    ref_bf16_bytes,
    wire_bytes,
)
from lynx_connector.lab.bench.e2e.targets import TARGETS, evaluate_targets, rederive_ideals

__all__ = [
    "CACHE_DTYPES", "MODES", "TARGETS", "TASKS", "ModelShape", "Plan", "add_parser", "build_prompts",
    "choose_rates", "counter_delta", "detect_speculative", "equality_by_row", "evaluate_targets", "ideal_ttfts",
    "kv_config", "main", "mark_output_equality", "measure_prefill", "merge_p_delta", "model_shape", "quantile", "rederive_ideals",
    "ref_bf16_bytes", "run", "run_rate", "scrape_counters", "speculative_serve_args", "start_deployment",
    "summarize_cell", "wire_bytes",
]
