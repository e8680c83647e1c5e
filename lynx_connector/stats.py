"""Connector statistics through vLLM's pipeline: the periodic "KV Transfer metrics" log line (``reduce``) and
Prometheus metrics (``LynxPromMetrics``). The payload is a plain dict of lists so it serializes between the
worker and the logger process and aggregates across tensor-parallel workers by concatenation.

Besides what the worker records per request, `TransportExporter` adds, about once a second, the transport's
own state: staging occupancy per side and worker (gauges) and the side channel's security and recovery events
(malformed frames, failed handshakes, leases that ran out, ...) as counter increments."""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from lynx_connector.auto import AUTO_REASONS
from lynx_connector.signing import REFUSAL_REASONS

_LIST_KEYS = ("anchor_bytes", "anchor_s", "residual_bytes", "residual_s", "request_s",
              "encode_anchor_bytes", "encode_residual_bytes", "encode_s",
              "spec_drafted", "spec_accepted", "spec_dropped", "spec_early", "spec_stop_low_margin",
              "spec_stop_first_token_mismatch")
#: Why a request's transfer failed (the ``reason`` label of ``vllm:lynx_failed_transfers``): D could not load it
#: (peer, transfer or deadline), D's integrity check refused it, no staging in time on P or D, too large for
#: P's pool, P's KV not finite, P's KV beyond the codec's range (|x| > 65504), P could not encode it.
FAILURE_REASONS = ("load", "integrity", "stage", "too_large", "nonfinite", "range", "encode")
_COUNT_KEYS = tuple(f"failed_{r}" for r in FAILURE_REASONS)
#: Refused kv_transfer_params by reason (the scheduler half: lynx_connector/signing.py); not transfer failures.
_REFUSED_KEYS = tuple(f"refused_{r}" for r in REFUSAL_REASONS)
#: Transport counters exported as ``vllm:lynx_side_channel_events{side, event}``: P's (source) and D's (sink)
#: names as in their ``stats()``.
SIDE_CHANNEL_EVENTS = {
    "p": ("malformed", "other_version", "auth_failed", "refused", "bad_mac", "replayed", "unknown_request", "wrong_ticket",
          "bad_notif", "replies_dropped", "freed_lease", "keepalive_gone", "logs_suppressed"),
    "d": ("bad_mac", "replayed", "sessions_lost", "reconnects", "resent", "lease_lost",
          "peer_closed", "peer_gone", "unsealed_ignored", "other_version"),
}
#: What the security seconds measure (``vllm:lynx_security_seconds{side, what}``): the per-layer checksums P
#: computes and D verifies, and the side channel's MACs (its service threads).
SECURITY_COSTS = ("checksum", "mac")
#: Staging gauges per side and worker: ``vllm:lynx_staging_bytes{side, rank, state}``.
STAGING_STATES = ("capacity", "used", "quarantined")


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {k: [] for k in _LIST_KEYS}
    data.update({k: 0 for k in _COUNT_KEYS + _REFUSED_KEYS})
    data["events"] = []  # [side, event, increment]
    data["auto"] = []  # [chosen mode, reason] per auto choice (P's scheduler half)
    data["gauges"] = []  # [side, rank, state, bytes]
    data["security"] = []  # [side, what, seconds]
    return data


class LynxStats(KVConnectorStats):
    def __init__(self, data: dict[str, Any] | None = None):
        super().__init__(data=_empty() if data is None else data)
        for k, v in _empty().items():
            self.data.setdefault(k, v)

    # ---- recording (worker) ----
    def record_stream(self, stream: str, nbytes: int, seconds: float) -> None:
        self.data[f"{stream}_bytes"].append(int(nbytes))
        self.data[f"{stream}_s"].append(float(seconds))

    def record_request(self, seconds: float) -> None:
        self.data["request_s"].append(float(seconds))

    def record_encode(self, anchor_bytes: int, residual_bytes: int, seconds: float) -> None:
        self.data["encode_anchor_bytes"].append(int(anchor_bytes))
        self.data["encode_residual_bytes"].append(int(residual_bytes))
        self.data["encode_s"].append(float(seconds))

    def record_security(self, side: str, what: str, seconds: float) -> None:
        """Seconds spent on integrity/authentication (``what`` of `SECURITY_COSTS`) on side "p" or "d"."""
        self.data["security"].append([side, what, float(seconds)])

    def record_failure(self, reason: str) -> None:
        """One failed request, by a reason of `FAILURE_REASONS`."""
        self.data[f"failed_{reason}"] += 1

    def record_refusal(self, reason: str) -> None:
        """Refused kv_transfer_params (scheduler half): ``reason`` one of signing.REFUSAL_REASONS."""
        self.data[f"refused_{reason}"] += 1

    def record_auto(self, mode: str, reason: str) -> None:
        """One ``auto`` choice (P): the mode chosen and why (lynx_connector.auto.AUTO_REASONS)."""
        self.data["auto"].append([mode, reason])

    def record_speculation(self, drafted: int, accepted: int, early: int = 0, stopped: str | None = None,
                           dropped: int = 0) -> None:
        """One speculative request: tokens decoded on the anchor and held, how many verification accepted,
        ``early`` tokens released on the anchor (P's full-precision first token), why decoding on the
        anchor stopped before the cap, if it did ("low_margin" or "first_token_mismatch"), and how many held
        tokens were dropped before verification reached them (preempted, residual failed, request finished)."""
        self.data["spec_drafted"].append(int(drafted))
        self.data["spec_accepted"].append(int(accepted))
        self.data["spec_dropped"].append(int(dropped))
        self.data["spec_early"].append(int(early))
        for reason in ("low_margin", "first_token_mismatch"):
            self.data[f"spec_stop_{reason}"].append(int(stopped == reason))

    # ---- KVConnectorStats protocol ----
    def reset(self) -> None:
        self.data = _empty()

    def clone_and_reset(self) -> LynxStats:
        out = LynxStats({k: (list(v) if isinstance(v, list) else v) for k, v in self.data.items()})
        self.reset()
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in (*_LIST_KEYS, "events", "gauges", "auto", "security")) and not any(
            self.data[k] for k in _COUNT_KEYS + _REFUSED_KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in (*_LIST_KEYS, "events", "gauges", "auto", "security"):
            self.data[k].extend(other.data.get(k, []))
        for k in _COUNT_KEYS + _REFUSED_KEYS:
            self.data[k] += int(other.data.get(k, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data

        def avg_ms(key: str) -> float:
            return round(1e3 * sum(d[key]) / len(d[key]), 3) if d[key] else 0.0

        def mb(key: str) -> float:
            return round(sum(d[key]) / 1e6, 3)

        out: dict[str, int | float] = {
            "Num pulls": len(d["request_s"]),
            "Anchor MB": mb("anchor_bytes"),
            "Residual MB": mb("residual_bytes"),
            "Avg time to anchor (ms)": avg_ms("anchor_s"),
            "Avg time to residual (ms)": avg_ms("residual_s"),
            "Num encodes": len(d["encode_s"]),
            "Avg encode (ms)": avg_ms("encode_s"),
            "Num failed": sum(d[k] for k in _COUNT_KEYS),
        }
        refused = sum(d[k] for k in _REFUSED_KEYS)
        if refused:
            out["Refused params"] = refused
        for mode, _reason in d["auto"]:
            key = f"Auto chose {mode}"
            out[key] = out.get(key, 0) + 1
        for side, event, n in d["events"]:
            key = f"Side channel {side.upper()} {event}"
            out[key] = out.get(key, 0) + int(n)
        if d["spec_drafted"]:
            drafted, accepted = sum(d["spec_drafted"]), sum(d["spec_accepted"])
            dropped = sum(d["spec_dropped"])
            out["First tokens released on the anchor"] = sum(d["spec_early"])
            out["Speculations stopped on a low margin"] = sum(d["spec_stop_low_margin"])
            out["Speculations stopped on a first-token mismatch"] = sum(d["spec_stop_first_token_mismatch"])
            out["Speculated tokens"] = drafted
            out["Accepted tokens"] = accepted
            out["Rejected tokens"] = drafted - accepted - dropped
            out["Dropped tokens"] = dropped
            out["Acceptance rate"] = round(accepted / drafted, 4) if drafted else 0.0  # as the benches: / speculated
        return out


class LynxPromMetrics(KVConnectorPromMetrics):
    """Per-engine Prometheus metrics: bytes and latency per stream, failures, speculation."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # up to concurrent_wait_s (120 s) and past it: in the pipelined flow the time includes P's queue and prefill
        buckets = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
        stream_labels = labelnames + ["stream"]
        self._bytes = self._counter_cls(name="vllm:lynx_transfer_bytes",
                                        documentation="KV bytes received per stream (anchor, residual).",
                                        labelnames=stream_labels)
        self._latency = self._histogram_cls(name="vllm:lynx_time_to_stream_seconds",
                                            documentation="Time from pull start to the stream landing on D.",
                                            buckets=buckets, labelnames=stream_labels)
        self._failed = self._counter_cls(name="vllm:lynx_failed_transfers",
                                         documentation="KV pulls or stagings that failed, by reason: "
                                                       + ", ".join(FAILURE_REASONS) + ".",
                                         labelnames=labelnames + ["reason"])
        self._events = self._counter_cls(name="vllm:lynx_side_channel_events",
                                         documentation="Side-channel security and recovery events per side "
                                                       "(p: malformed frames, failed handshakes, leases that ran "
                                                       "out, ...; d: bad MACs, reconnects, leases lost, ...).",
                                         labelnames=labelnames + ["side", "event"])
        self._staging = self._gauge_cls(name="vllm:lynx_staging_bytes",
                                        documentation="Staging pool bytes per side and worker rank: capacity, used "
                                                      "(including quarantined) and quarantined (freed by a lease "
                                                      "that ran out, not reusable yet).",
                                        multiprocess_mode="mostrecent",
                                        labelnames=labelnames + ["side", "rank", "state"])
        self._spec = self._counter_cls(name="vllm:lynx_speculative_tokens",
                                       documentation="Tokens decoded on the anchor (drafted), accepted and "
                                                     "rejected by verification, dropped before it (preempted, "
                                                     "residual failed or request finished); first tokens "
                                                     "released on the anchor (released_on_anchor).",
                                       labelnames=labelnames + ["outcome"])
        self._stopped = self._counter_cls(name="vllm:lynx_speculation_stops",
                                          documentation="Requests whose decoding on the anchor stopped before the "
                                                        "cap: low_margin (confidence gate) or "
                                                        "first_token_mismatch (D's first token is not P's).",
                                          labelnames=labelnames + ["reason"])

        self._security = self._counter_cls(name="vllm:lynx_security_seconds",
                                           documentation="Seconds spent on integrity and authentication per "
                                                         "side: checksums (P computes, D verifies, per layer "
                                                         "and plane) and the side channel's MACs.",
                                           labelnames=labelnames + ["side", "what"])
        self._auto = self._counter_cls(name="vllm:lynx_auto_choices",
                                       documentation="Transfer modes chosen by auto on P, by mode and reason: "
                                                     + ", ".join(AUTO_REASONS) + ".",
                                       labelnames=labelnames + ["mode", "reason"])
        self._refused = self._counter_cls(name="vllm:lynx_refused_params",
                                          documentation="kv_transfer_params refused by the scheduler half: "
                                                        + ", ".join(REFUSAL_REASONS) + ".",
                                          labelnames=labelnames + ["reason"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for stream in ("anchor", "residual"):
            nbytes = transfer_stats_data.get(f"{stream}_bytes", [])
            if nbytes:
                self._bytes.labels(*labels, stream).inc(sum(nbytes))
            for s in transfer_stats_data.get(f"{stream}_s", []):
                self._latency.labels(*labels, stream).observe(s)
        for reason in FAILURE_REASONS:
            n = int(transfer_stats_data.get(f"failed_{reason}", 0))
            if n:
                self._failed.labels(*labels, reason).inc(n)
        for side, event, n in transfer_stats_data.get("events", []):
            self._events.labels(*labels, side, event).inc(n)
        for side, rank, state, value in transfer_stats_data.get("gauges", []):
            self._staging.labels(*labels, side, str(rank), state).set(value)
        drafted = sum(transfer_stats_data.get("spec_drafted", []))
        if drafted:
            self._spec.labels(*labels, "drafted").inc(drafted)
            accepted = sum(transfer_stats_data.get("spec_accepted", []))
            dropped = sum(transfer_stats_data.get("spec_dropped", []))
            self._spec.labels(*labels, "accepted").inc(accepted)
            self._spec.labels(*labels, "rejected").inc(drafted - accepted - dropped)
            self._spec.labels(*labels, "dropped").inc(dropped)
        early = sum(transfer_stats_data.get("spec_early", []))
        if early:
            self._spec.labels(*labels, "released_on_anchor").inc(early)
        for reason in ("low_margin", "first_token_mismatch"):
            n = sum(transfer_stats_data.get(f"spec_stop_{reason}", []))
            if n:
                self._stopped.labels(*labels, reason).inc(n)
        for side, what, seconds in transfer_stats_data.get("security", []):
            self._security.labels(*labels, side, what).inc(seconds)
        for mode, reason in transfer_stats_data.get("auto", []):
            self._auto.labels(*labels, mode, reason).inc()
        for reason in REFUSAL_REASONS:
            n = int(transfer_stats_data.get(f"refused_{reason}", 0))
            if n:
                self._refused.labels(*labels, reason).inc(n)


class TransportExporter:
    """Copies a worker's transport state into its `LynxStats` about once a second: staging gauges and the
    increments of the side-channel counters since the last export (only what changed is sent)."""

    def __init__(self, rank: int = 0, interval_s: float = 1.0) -> None:
        self.rank, self._interval = rank, interval_s  # the worker's tensor-parallel rank
        self._next = 0.0
        self._last_counts: dict[tuple[str, str], int] = {}
        self._last_gauges: dict[tuple[str, str], int] = {}
        self._last_mac: dict[str, float] = {}

    def maybe_export(self, stats: LynxStats, endpoints: dict[str, Any]) -> None:
        """``endpoints``: {"p": TransferSource or None, "d": TransferSink or None}."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._interval
        for side, end in endpoints.items():
            if end is None:
                continue
            st = end.stats()
            for event in SIDE_CHANNEL_EVENTS[side]:
                n, last = int(st.get(event, 0)), self._last_counts.get((side, event), 0)
                if n > last:
                    stats.data["events"].append([side, event, n - last])
                self._last_counts[side, event] = n
            mac, last_mac = float(st.get("mac_s", 0.0)), self._last_mac.get(side, 0.0)
            if mac > last_mac:
                stats.data["security"].append([side, "mac", mac - last_mac])
            self._last_mac[side] = mac
            pool = end.pool
            for state, value in zip(STAGING_STATES, (pool.nbytes, pool.bytes_allocated, pool.quarantined_bytes),
                                    strict=True):
                if self._last_gauges.get((side, state)) != value:
                    stats.data["gauges"].append([side, self.rank, state, value])
                    self._last_gauges[side, state] = value
