"""What P chose for the bench's ``auto`` requests, and which proxy flow really carried each cell.

``auto`` (lynx_connector/auto.py) is decided on P when the request is scheduled; the client's stream does not
carry it (vLLM returns ``kv_transfer_params`` only in a non-streamed answer, and the proxy sends P's params to D,
not to the client). Two records of it exist:

* P's counter ``vllm:lynx_auto_choices{mode,reason}``: exact per cell (its delta over the cell), no request ids;
* P's log line ``Request <id>: auto chose <mode> (<reason>)``, with vLLM's request id ``cmpl-<X-Request-Id>-...``:
  the bench sends each request with its own ``X-Request-Id`` (the proxy forwards it to P), so each request's
  choice is found there.

:func:`attribute` gives every request of a cell its mode: from the log when the log names every request and its
counts agree with the counter's delta (``p_log``); else, when the counter names one mode only, that mode for all
(``p_metrics``); else none (``unresolved``: the row keeps the counts, its bytes and ideal TTFT stay unknown).

The proxy's ``/lynx/stats`` counts the requests it sent each flow: its delta over a cell is the flow actually
used (the first request to each P goes the sequential way, while the proxy learns P's side channel).
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

AUTO_METRIC = "vllm:lynx_auto_choices"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_LOG = re.compile(r"Request (?P<id>\S+): auto chose (?P<mode>\w+) \((?P<reason>\w+)\)")

Choices = dict[tuple[str, str], float]


def parse_auto_choices(text: str) -> Choices:
    """``{(mode, reason): count}`` from a Prometheus text page (the ``_total`` samples of ``AUTO_METRIC``, summed
    over engines)."""
    out: Choices = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m["name"] not in (AUTO_METRIC, AUTO_METRIC + "_total"):
            continue
        labels = dict(_LABEL.findall(m["labels"]))
        if "mode" not in labels or "reason" not in labels:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        key = (labels["mode"], labels["reason"])
        out[key] = out.get(key, 0.0) + value
    return out


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode("utf-8", "replace")
    except OSError as exc:
        logger.warning("cannot read %s: %s", url, exc)
        return None


def scrape_auto_choices(p_url: str) -> Choices | None:
    """P's auto choices so far (None: P's /metrics could not be read)."""
    text = _get(p_url.rstrip("/") + "/metrics")
    return None if text is None else parse_auto_choices(text)


def choice_delta(before: Choices | None, after: Choices | None) -> dict[tuple[str, str], int] | None:
    if before is None or after is None:
        return None
    return {k: int(round(v - before.get(k, 0.0))) for k, v in after.items() if round(v - before.get(k, 0.0)) > 0}


def scrape_flows(proxy_url: str) -> dict[str, int] | None:
    """The proxy's requests per flow so far (``/lynx/stats``), None when it cannot be read."""
    text = _get(proxy_url.rstrip("/") + "/lynx/stats")
    try:
        flows = json.loads(text)["flows"] if text else None
    except (ValueError, KeyError, TypeError):
        flows = None
    return {str(k): int(v) for k, v in flows.items()} if isinstance(flows, dict) else None


def flow_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}


def log_size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def read_log(path: Path, offset: int) -> str:
    """P's log from ``offset`` on ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def parse_choice_log(text: str, request_ids: list[str]) -> dict[str, tuple[str, str]]:
    """``{request id: (mode, reason)}`` for the ids whose auto choice P logged. vLLM's id of a completion is
    ``cmpl-<X-Request-Id>-<prompt index>`` (plus a random suffix), so an id matches the line whose vLLM id starts
    with ``cmpl-<id>-``; a fanned-out request's children (several lines) keep the first."""
    out: dict[str, tuple[str, str]] = {}
    for m in _LOG.finditer(text):
        engine_id = m["id"]
        for rid in request_ids:
            if rid not in out and engine_id.startswith(f"cmpl-{rid}-"):
                out[rid] = (m["mode"], m["reason"])
    return out


def attribute(requests: list[dict], logged: dict[str, tuple[str, str]],
              delta: dict[tuple[str, str], int] | None) -> str:
    """Set ``auto_mode`` / ``auto_reason`` on each request of an auto cell (``request_id`` keys ``logged``);
    return the source (module docstring)."""
    from_log = [logged.get(r.get("request_id", "")) for r in requests]
    counts = Counter(c for c in from_log if c is not None)
    if all(c is not None for c in from_log) and (delta is None or counts == Counter(delta)):
        for r, c in zip(requests, from_log, strict=True):
            r["auto_mode"], r["auto_reason"] = c
        return "p_log"
    modes = {m for m, _ in (delta or {})}
    if delta and len(modes) == 1 and sum(delta.values()) == len(requests):
        reasons = {reason for _, reason in delta}
        for r in requests:
            r["auto_mode"] = next(iter(modes))
            r["auto_reason"] = next(iter(reasons)) if len(reasons) == 1 else None
        return "p_metrics"
    if delta is not None or counts:
        logger.warning("auto choices of %d requests not attributable (log %s, metrics %s)", len(requests),
                       dict(counts), delta)
    for r in requests:
        r["auto_mode"], r["auto_reason"] = None, None
    return "unresolved"


def summarize_choices(requests: list[dict], delta: dict[tuple[str, str], int] | None) -> dict[str, Any]:
    """The row's ``chosen`` (mode: count) and ``chosen_reasons`` (reason: count): P's counter delta when it was
    read, else what the requests were attributed."""
    pairs: Counter = Counter(delta) if delta is not None else Counter(
        (r["auto_mode"], r["auto_reason"]) for r in requests if r.get("auto_mode"))
    chosen: Counter = Counter()
    reasons: Counter = Counter()
    for (mode, reason), n in pairs.items():
        chosen[mode] += n
        reasons[reason] += n
    return {"chosen": dict(chosen), "chosen_reasons": dict(reasons)}
