"""What ``lynx bench e2e`` runs and the arithmetic it judges by: modes and default sizes, the model's KV shape,
the bytes each mode puts on the wire, the ideal TTFT of a request or a batch, the link rates that make a regime,
D's KVTransferConfig and the prompts. No process, no HTTP: everything here is pure and tested on numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lynx_connector.modes import comparison_order, get_mode

#: The modes of the default run: all but int4_kivi (int4's bytes on the wire, so int4's TTFT; it would only
#: lengthen the run).
MODES = tuple(m for m in comparison_order() if m != "int4_kivi")
DEFAULT_RATIOS = (0.5, 2.0, 10.0)
DEFAULT_LENGTHS = (1024,)
DEFAULT_REPEATS = 2
DEFAULT_CONC_LENGTH = 1024
#: Concurrency > 1 runs at these ratios by default (the balanced regime: at 10x a batch of 4 fp32
#: passthrough transfers alone would take ~5 minutes and the default run must stay under 30).
DEFAULT_CONC_RATIOS = (2.0,)
QUICK_LENGTH = 512
#: The regimes are defined by the bytes of a 16-bit BF16 transfer (the paper's BF16), whatever the cache
#: dtype: on CPU the cache is fp32, so the "bf16" mode (passthrough) moves twice those bytes.
REF_BYTES_PER_VALUE = 2
QUICK_LINK_GBPS = 0.25
MAX_MODEL_LEN = 4096
CACHE_DTYPES = ("float32", "bfloat16", "float16")
TASKS = ("summary", "needle")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int


def model_shape(model: str) -> ModelShape:
    """Layers, KV heads and head size of ``model`` (a local folder or a cached Hugging Face name)."""
    local = Path(model) / "config.json"
    if local.exists():
        cfg = json.loads(local.read_text())
    else:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model).to_dict()
    cfg = cfg.get("text_config", cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return ModelShape(cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                      head_dim)


def wire_bytes(mode: str, num_tokens: int, shape: ModelShape, cache_dtype: str = "float32") -> tuple[int, int]:
    """``(bytes needed before the first client-visible token, bytes on the wire)`` for one request: the modes
    table's ``wire_nbytes`` for every layer.

    anchor: the residual is never pulled. speculative (greedy): the first token is P's, released when D's
    first token on the anchor agrees with it, so it needs the anchor plane only; the later ones wait for the
    residual (verification)."""
    import torch

    first, total = get_mode(mode).wire_nbytes(num_tokens, shape.kv_heads, shape.head_dim, getattr(torch, cache_dtype))
    return first * shape.layers, total * shape.layers


def quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated quantile (q in [0, 1]); None for no values."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = q * (len(vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def ideal_ttfts(prefill_s: float, first_bytes: list[int], link_gbps: float | None) -> list[float]:
    """Ideal TTFT of each request of a batch sent at once: P prefills them one after another, the link carries
    each request's needed bytes in order as soon as its prefill is done (unpaced link: transfer time 0)."""
    out = []
    link_free = 0.0
    for k, nbytes in enumerate(first_bytes):
        ready = (k + 1) * prefill_s
        xfer = 0.0 if not link_gbps else nbytes * 8 / (link_gbps * 1e9)
        done = max(ready, link_free) + xfer
        link_free = done
        out.append(done)
    return out


def limit_ttfts(prefill_s: float, first_bytes: list[int], link_gbps: float | None, step_s: float) -> list[float]:
    """The pipelined flow's limit for each request of a batch sent at once: P prefills them one after another;
    request ``k``'s bytes may cross the link while it is prefilled (from ``k * prefill_s``, after the earlier
    requests' bytes); its first token comes one decode step after both its prefill and its needed bytes are done:
    ``max(prefill, bytes / link) + step`` at concurrency 1."""
    out = []
    link_free = 0.0
    for k, nbytes in enumerate(first_bytes):
        xfer = 0.0 if not link_gbps else nbytes * 8 / (link_gbps * 1e9)
        link_free = max(k * prefill_s, link_free) + xfer
        out.append(max((k + 1) * prefill_s, link_free) + step_s)
    return out


def cell_rounds(first_bytes: list[int], conc: int, batches: int = 1) -> list[list[int]]:
    """A cell's requests (in the order sent) grouped as they were sent at once: at concurrency 1 each on its own,
    else one group per round (``--batches``; the rounds are equal, consecutive parts of the cell's requests)."""
    if conc == 1:
        return [[b] for b in first_bytes]
    rounds = max(1, batches)
    if len(first_bytes) % rounds:
        raise ValueError(f"{len(first_bytes)} requests do not split into {rounds} equal rounds")
    size = len(first_bytes) // rounds
    return [list(first_bytes[i:i + size]) for i in range(0, len(first_bytes), size)]


def cell_limits(prefill_s: float, first_bytes: list[int], link_gbps: float | None, conc: int,
                step_s: float, batches: int = 1) -> list[float]:
    """Limit TTFTs of a cell's requests (:func:`limit_ttfts`), each round of the cell on its own
    (:func:`cell_rounds`)."""
    return [t for group in cell_rounds(first_bytes, conc, batches)
            for t in limit_ttfts(prefill_s, group, link_gbps, step_s)]


def cell_ideals(prefill_s: float, first_bytes: list[int], link_gbps: float | None, conc: int,
                batches: int = 1) -> list[float]:
    """Ideal TTFTs of a cell's requests (:func:`ideal_ttfts`), each round of the cell on its own
    (:func:`cell_rounds`): a round's requests were sent at once, the next round only after it had finished."""
    return [t for group in cell_rounds(first_bytes, conc, batches)
            for t in ideal_ttfts(prefill_s, group, link_gbps)]


def ttft_floors(ttft_s: float | None, prefill_s: float, first_bytes: list[int] | None, link_gbps: float | None,
                conc: int, step_s: float | None, batches: int = 1) -> dict[str, float | None]:
    """A row's ideal and pipelined limit TTFT (medians over the cell's requests: :func:`cell_ideals`,
    :func:`cell_limits`) and its measured median TTFT over each; all None when a request's needed bytes are
    unknown (``first_bytes`` None: an auto request whose choice is)."""
    ideal = limit = None
    if first_bytes is not None:
        ideal = quantile(cell_ideals(prefill_s, first_bytes, link_gbps, conc, batches), 0.5)
        limit = quantile(cell_limits(prefill_s, first_bytes, link_gbps, conc, step_s or 0.0, batches), 0.5)
    return {"ideal_ttft_s": ideal, "ttft_vs_ideal": ttft_s / ideal if ttft_s and ideal else None,
            "limit_ttft_s": limit, "ttft_vs_limit": ttft_s / limit if ttft_s and limit else None}


def ref_bf16_bytes(num_tokens: int, shape: ModelShape) -> int:
    """Bytes of a 16-bit BF16 transfer of ``num_tokens`` tokens (K and V, every layer): what defines a regime."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * REF_BYTES_PER_VALUE * num_tokens


def choose_rates(prefill_s: float, ref_tokens: int, shape: ModelShape, ratios: list[float]) -> list[float]:
    """Link rates (Gbit/s) at which a 16-bit BF16 transfer of ``ref_tokens`` takes ``ratio x prefill_s``."""
    return [float(f"{ref_bf16_bytes(ref_tokens, shape) * 8 / (ratio * prefill_s) / 1e9:.4g}") for ratio in ratios]


def kv_config(link_gbps: float | None, spec_min_margin: float | None = None,
              auto_speculative: bool | None = None) -> str:
    # every mode of the comparison on one P/D pair: allowed explicitly (the default is full precision only)
    extra: dict[str, Any] = {"mode": "full", "link_gbps": link_gbps, "allowed_modes": "all"}
    if spec_min_margin is not None:
        extra["speculative_min_margin"] = spec_min_margin
    if auto_speculative is not None:  # P's auto: whether D speculates (P itself runs no speculative scheduler)
        extra["auto_speculative"] = auto_speculative
    return json.dumps({"kv_connector": "lynx", "kv_connector_extra_config": extra})


@dataclass
class Plan:
    modes: list[str]
    lengths: list[int]
    repeats: int
    concurrency: list[int]
    conc_length: int
    max_tokens: int
    cache_dtype: str = "float32"
    max_model_len: int = MAX_MODEL_LEN
    serve_args: tuple[str, ...] = ()
    p_cpus: str | None = None
    d_cpus: str | None = None
    #: D's speculative_min_margin (None: the connector's default).
    spec_min_margin: float | None = None
    #: The proxy flows compared (lynx_connector.concurrent.FLOWS): one proxy each, in front of the same P and D.
    flows: tuple[str, ...] = ("sequential", "pipelined")
    #: P's auto_speculative (None: auto not run): D runs the speculative scheduler.
    auto_speculative: bool | None = None
    #: Rounds per cell, the mode order rotated by one between rounds (``--batches``); a row covers all of them.
    batches: int = 1


def build_prompts(tok: Any, lengths: list[int], count: int, task: str = "summary") -> dict[int, list[Any]]:
    from lynx_connector.lab.data import build_needle_prompt, build_summary_prompt

    if task == "summary":  # a different essay per prompt
        return {n: [build_summary_prompt(tok, n, seed=7 * i + n // 1024) for i in range(count)] for n in lengths}
    depths = (0.2, 0.5, 0.8, 0.35, 0.65, 0.1, 0.9, 0.45)
    return {n: [build_needle_prompt(tok, n, depth=depths[i % len(depths)], seed=1000 + 17 * n + i)
                for i in range(count)] for n in lengths}
