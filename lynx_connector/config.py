"""The connector's typed configuration, built once from ``kv_transfer_config.kv_connector_extra_config``.

One source of truth: the extra config. Values may arrive as strings (dotted CLI keys, YAML, environment), so
numbers and booleans are parsed here; unknown keys are warned about (a typo must not pass silently) and bad
values raise ``LynxConfigError`` naming the key. The resolved config is logged once by the connector.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lynx_connector.limits import MAX_SECONDS, advertised_host_problem, bracketed
from lynx_connector.logger import init_logger
from lynx_connector.modes import (
    AUTO_MODE,
    DEFAULT_MODE,
    LYNX_CODEC,
    MODE_NAMES,
    auto_candidates,
    default_allowed_modes,
    get_mode,
    is_requestable,
)
from lynx_connector.testing import FAULT_INJECTIONS

if TYPE_CHECKING:
    from lynx_connector.transport.config import TransportConfig

logger = init_logger(__name__)

#: The per-request form of ``report_speculation``: ``kv_transfer_params: {"lynx_report": true}`` on a request to D
#: (``lynx proxy`` adds it to D's params when the client sent it) returns that request's speculation summary.
REPORT_KEY = "lynx_report"


DEFAULT_LEASE_S = 120.0
#: The durations a user sets, in seconds: each at most ``limits.MAX_SECONDS``.
SECONDS_KEYS = ("lease_s", "timeout_s", "params_ttl_s", "concurrent_wait_s", "max_stream_wait_s", "auto_window_s")


class LynxConfigError(ValueError):
    """A configuration value is invalid; the message names the key and what is accepted."""


def _shown(value: Any) -> str:
    """``repr(value)`` for an error message, cut short (a number may have hundreds of digits)."""
    text = repr(value)
    return text if len(text) <= 64 else text[:60] + "..."


def _is_null(value: Any) -> bool:
    """Whether a value means "not set" (the key's default): JSON null, or as text (dotted CLI keys, YAML) an empty
    string, ``none`` or ``null`` in any case. Every key that can be unset reads it so."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))


def _as_float(key: str, value: Any, *, minimum: float | None = None, allow_none: bool = False) -> float | None:
    if _is_null(value):
        if allow_none:
            return None
        raise LynxConfigError(f"{key}: a number is required")
    if isinstance(value, bool):
        raise LynxConfigError(f"{key}: expected a number, got {_shown(value)}")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise LynxConfigError(f"{key}: expected a finite number, got {_shown(value)}") from None
    if not math.isfinite(out):
        raise LynxConfigError(f"{key}: must be finite, got {_shown(value)}")
    if minimum is not None and out < minimum:
        raise LynxConfigError(f"{key}: must be >= {minimum}, got {_shown(value)}")
    return out


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        value = value.strip().lower() in ("true", "1", "yes")
    if not isinstance(value, bool):
        raise LynxConfigError(f"{key}: expected true or false, got {_shown(value)}")
    return value


def _as_int(key: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool):
        raise LynxConfigError(f"{key}: expected an integer, got {_shown(value)}")
    try:
        out = int(str(value).strip(), 0) if isinstance(value, str) else int(value)
    except (TypeError, ValueError, OverflowError):
        raise LynxConfigError(f"{key}: expected an integer, got {_shown(value)}") from None
    if isinstance(value, float) and value != out:
        raise LynxConfigError(f"{key}: expected an integer, got {_shown(value)}")
    if out < minimum or (maximum is not None and out > maximum):
        hi = "" if maximum is None else f" and <= {maximum}"
        raise LynxConfigError(f"{key}: must be >= {minimum}{hi}, got {_shown(value)}")
    return out


def _as_codec_options(value: Any) -> Any:
    """``codec_options`` from the extra config: group sizes may arrive as strings (YAML, dotted CLI keys), and are
    parsed like every other integer; the codec checks the rest (``LynxConfig``)."""
    if not isinstance(value, Mapping):
        return value
    return {k: _as_int(f"codec_options.{k}", v, minimum=1) if str(k).endswith("_tokens") and v is not None else v
            for k, v in value.items()}


def _as_modes(key: str, value: Any) -> tuple[str, ...]:
    """Mode names from a list or a comma-separated string (``all``: every mode); validated by LynxConfig."""
    if isinstance(value, str):
        items = [v for v in (x.strip().lower() for x in value.split(",")) if v]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = [v.strip().lower() for v in value]
    else:
        raise LynxConfigError(f"{key}: expected a list of mode names or a comma-separated string, got {value!r}")
    if items == ["all"]:
        return (*MODE_NAMES, AUTO_MODE)
    if not items:
        raise LynxConfigError(f"{key}: must name at least one mode (or all); omit it for the default")
    return tuple(dict.fromkeys(items))


@dataclass(frozen=True)
class LynxConfig:
    """Resolved connector configuration (see docs/OPERATIONS.md for the table of keys)."""

    #: Transfer mode: a row of the modes table in lynx_connector/modes.py ("Transfer modes" in
    #: docs/OPERATIONS.md), or ``auto`` (P picks passthrough, full or speculative per request: "Auto mode" in
    #: docs/OPERATIONS.md); a request may ask for another one with ``lynx_mode``.
    mode: str = DEFAULT_MODE
    #: Options for the Lynx codec (grouping: k_group, v_group, k_group_tokens, v_group_tokens, group_tokens: at most
    #: 8192 tokens); passed to ``lynx_connector.codec.get_codec`` and checked at start-up whatever ``mode`` is (a
    #: request may ask for a Lynx mode).
    codec_options: Mapping[str, Any] = field(default_factory=dict)
    #: Emulated link rate (D paces its pulls on a virtual link clock), Gbit/s; None = unpaced.
    link_gbps: float | None = None
    #: Transfer chunk size (the priority granularity of the two streams), bytes.
    chunk_bytes: int = 1 << 20
    #: D's bytes in flight: how many chunks' reads are posted at once, bytes.
    window_bytes: int = 8 << 20
    #: Staging memory registered with NIXL once, per worker and role, MiB: kv_both holds a pool to send and one to
    #: receive (2x; kv_producer and kv_consumer one), resident from start, which must fit the memory available
    #: (else a start-up error). One request's planes must fit whole: the worker warns at start when max_model_len
    #: tokens do not fit in an allowed mode, naming the staging_mb that does, and P refuses a longer prompt in that
    #: mode before staging it (a 400 lynx_error).
    staging_mb: int = 256
    #: P's side channel (zmq): the address P binds and tells D through kv_transfer_params (one D can reach: a
    #: host name, an IPv4 address or an IPv6 one, bracketed or not; a wildcard such as 0.0.0.0 or ::, a host:port
    #: or a URL is a start-up error).
    side_channel_host: str = "127.0.0.1"
    #: P's side-channel port (rank r of a TP group uses port + r); 0 picks a free port, told to D the same way.
    side_channel_port: int = 0
    #: P frees a request's staging when D has neither finished nor renewed it for this many seconds (D renews
    #: every request it pulls or P has staged for it, every quarter of P's lease; not, in the sequential flow,
    #: one still waiting up to timeout_s for D's own staging). null: 120, or 1.25x the time a full pool takes to
    #: drain at ``link_gbps``, or timeout_s, whichever is longest. A lease set shorter than that drain time
    #: (staging_mb at link_gbps) or than timeout_s is a start-up error (and D warns of a P whose lease is
    #: shorter than its own timeout_s).
    lease_s: float | None = None
    #: D gives up on a silent or vanished P after this many seconds (then kv_load_failure_policy applies).
    timeout_s: float = 30.0
    #: Speculation cap on D (tokens decoded on the anchor before the request waits for the residual).
    max_speculative_tokens: int = 64
    #: Confidence gate for greedy speculation on D: a token decoded on the anchor whose logit margin (top token
    #: minus the runner-up, in nats) is below this is not held, and the request waits for the residual (its
    #: followers would be verified against an uncertain token). 0 holds every token up to the cap.
    speculative_min_margin: float = 0.4
    #: D returns every speculative request's summary (``kv_transfer_params.lynx_speculation`` of its final output);
    #: off: only to requests whose kv_transfer_params carry ``"lynx_report": true``, the others get vLLM's null.
    report_speculation: bool = False
    #: Test-only fault injection: "corrupt_residual" flips the residual bits D merges (after its checksum).
    fault_injection: str | None = None
    #: A folder where each worker's transport writes its live counters (staging, pulls, requests waiting for
    #: staging) as JSON about once a second, also while the engine is idle (benchmarks, debugging); null = off.
    status_dir: str | None = None
    #: Run the side channel without the deployment key (LYNX_SIDE_CHANNEL_KEY_FILE / LYNX_SIDE_CHANNEL_KEY):
    #: unauthenticated, anyone who reaches P's port can read staged KV. Local tests only; logged as a warning.
    insecure_side_channel: bool = False
    #: The transfer modes a request may ask for (``lynx_mode``): mode names or ``auto`` (a list, or a
    #: comma-separated string; ``all`` = every mode and auto). Omitted or null = the full-precision modes (full,
    #: speculative, bf16), auto, plus ``mode``. P refuses a request for another mode (400 through the proxy); D
    #: refuses params naming one. ``auto`` chooses only among the allowed full-precision modes.
    allowed_modes: tuple[str, ...] = ()
    #: How long the kv_transfer_params P signs stay valid for D, seconds; null = P's lease (``lease_s`` as
    #: resolved: P frees an unread request's staging by then anyway). P's and D's clocks must agree well within it.
    params_ttl_s: float | None = None
    #: P encodes and publishes a request's planes layer by layer inside the forward of the step in which its
    #: prompt completes (``save_kv_layer``), so D reads the first layers while P computes the rest (pipelined
    #: transfer, docs/PROTOCOL.md section 6); false: after the forward, the whole request at once.
    layerwise: bool = True
    #: D, concurrent flow (``lynx proxy --flow pipelined`` sends a request to P and D at once): how long D waits
    #: for P to start publishing it (P's queue and prefill) before ``kv_load_failure_policy`` applies, seconds.
    #: D holds the request's KV blocks meanwhile.
    concurrent_wait_s: float = 120.0
    #: How D ranks the streams of concurrent pulls (lynx_connector/transport/ranking.py): ``srpt`` (speculative
    #: anchors first, then the units that unblock output, fewest bytes left first), ``arrival`` (those units in
    #: the order they became ready) or ``anchor_first`` (every anchor before any residual: the rule before issue
    #: 16, for comparison).
    transfer_order: str = "srpt"
    #: The ranking's age bound on D: a stream queued this many seconds goes first, oldest first.
    max_stream_wait_s: float = 5.0
    #: D: an engine step with nothing to compute while pulls are in flight waits up to this long for one of them
    #: to land (it returns the moment one does), instead of returning at once: vLLM runs such empty steps in a
    #: busy loop, which takes the CPU from a P on the same machine (the concurrent flow's D waits through P's whole
    #: prefill). A request arriving at an idle D meanwhile waits at most this long; 0 = no wait. Seconds, <= 1.
    idle_wait_s: float = 0.02
    #: D, speculative mode: when a request's anchor lands and the rest of its residual (all published by P) is
    #: due within this long at the link's rate (``link_gbps``, else the rate the anchor achieved), D waits that
    #: long for it and decodes at full precision instead of starting on the anchor: a step on the anchor would be
    #: followed by the merge and a verification step anyway (about one decode step: 0.05 s for the lab model on
    #: this CPU). 0 = always start on the anchor. Seconds, <= 1.
    residual_grace_s: float = 0.05
    #: ``auto`` (P): the configured link's rate is used when ``link_gbps`` is set; otherwise P measures it from
    #: the transfers D completed within this many recent seconds (none yet: passthrough).
    auto_window_s: float = 30.0
    #: ``auto`` (P): whether its Ds can speculate (run the speculative scheduler); null = when P itself runs it
    #: (the ``lynx:auto`` preset sets it on P and D alike) or P is prefill-only (``kv_role`` ``kv_producer``:
    #: no scheduler there, its Ds are taken to run the same preset). Set it true on another P without the
    #: scheduler whose Ds run ``lynx:speculative`` or ``lynx:auto``, false when its Ds cannot speculate.
    auto_speculative: bool | None = None

    def __post_init__(self) -> None:
        if not is_requestable(self.mode):
            raise LynxConfigError(f"mode: expected one of {', '.join(MODE_NAMES)} or {AUTO_MODE}, got {self.mode!r}")
        if not self.allowed_modes:
            default = (*default_allowed_modes(), AUTO_MODE)
            allowed = default if self.mode in default else (*default, self.mode)
            object.__setattr__(self, "allowed_modes", allowed)
        else:
            bad = [m for m in self.allowed_modes if not is_requestable(m)]
            if bad:
                raise LynxConfigError(f"allowed_modes: {bad} are not transfer modes (valid: {', '.join(MODE_NAMES)}"
                                      f", {AUTO_MODE}, or all)")
            if self.mode not in self.allowed_modes:
                raise LynxConfigError(f"allowed_modes {list(self.allowed_modes)} must include the instance's own "
                                      f"mode {self.mode!r}")
        if AUTO_MODE in self.allowed_modes and not self.auto_modes:
            raise LynxConfigError(f"allowed_modes {list(self.allowed_modes)}: auto needs at least one of "
                                  f"{', '.join(auto_candidates())} allowed (it never picks a lossy mode)")
        from lynx_connector.transport.ranking import ORDERS

        if self.transfer_order not in ORDERS:
            raise LynxConfigError(f"transfer_order: expected one of {', '.join(ORDERS)}, got {self.transfer_order!r}")
        for name in ("idle_wait_s", "residual_grace_s"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise LynxConfigError(f"{name}: must be in [0, 1] seconds, got {getattr(self, name)!r}")
        if self.window_bytes < self.chunk_bytes:
            raise LynxConfigError(
                f"window_bytes ({self.window_bytes}) must be >= chunk_bytes ({self.chunk_bytes})"
            )
        problem = advertised_host_problem(self.side_channel_host)
        if problem:
            raise LynxConfigError(f"side_channel_host: {problem}; got {_shown(self.side_channel_host)}")
        if self.fault_injection is not None and self.fault_injection not in FAULT_INJECTIONS:
            raise LynxConfigError(f"fault_injection: expected {' or '.join(map(repr, FAULT_INJECTIONS))} or none, "
                                  f"got {self.fault_injection!r}")
        self._check_seconds()
        self._check_codec_options()

    def _check_seconds(self) -> None:
        for name in SECONDS_KEYS:
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
                raise LynxConfigError(f"{name}: must be > 0 and <= {MAX_SECONDS:g} seconds, got {value!r}")
        from lynx_connector.transport.config import lease_problem  # the transport package loads torch, zmq

        if self.lease_s is None and self.effective_lease_s > MAX_SECONDS:
            raise LynxConfigError(
                f"link_gbps={self.link_gbps:g} with staging_mb={self.staging_mb}: a full staging pool takes longer to "
                f"drain than any lease may be ({MAX_SECONDS:g} s; P's lease defaults to 1.25x the drain time): raise "
                f"link_gbps or lower staging_mb")
        problem = lease_problem(self.lease_s, self.staging_mb << 20, self.link_gbps)
        if problem:
            raise LynxConfigError(problem)
        if self.lease_s is not None and self.lease_s < self.timeout_s:
            raise LynxConfigError(f"lease_s={self.lease_s:g} is shorter than timeout_s={self.timeout_s:g}: D waits up to "
                                  "timeout_s for its own staging before it pulls a request, and P's lease is not "
                                  "renewed meanwhile; set lease_s >= timeout_s (or leave it null)")

    def _check_codec_options(self) -> None:
        """Build the Lynx codec with ``codec_options`` once, whatever the instance's own mode: a request may ask for
        any allowed Lynx mode, and a bad option must fail start-up, not that request."""
        if not isinstance(self.codec_options, Mapping):
            raise LynxConfigError(f"codec_options: expected a mapping, got {self.codec_options!r}")
        if not self.codec_options:
            return
        from lynx_connector.codec import get_codec

        try:
            get_codec(LYNX_CODEC, **self.codec_options)
        except (TypeError, ValueError) as e:
            raise LynxConfigError(f"codec_options {dict(self.codec_options)!r}: {e}") from None

    @property
    def signed_params_ttl_s(self) -> float:
        """How long signed kv_transfer_params stay valid (``params_ttl_s``; default: P's effective lease, the
        ``lease_s`` the transport runs with, which P keeps an unread request's staging for)."""
        if self.params_ttl_s is not None:
            return self.params_ttl_s
        return self.effective_lease_s

    def mode_allowed(self, mode: str) -> bool:
        return mode in self.allowed_modes

    @property
    def auto_modes(self) -> tuple[str, ...]:
        """The modes ``auto`` may pick here: the full-precision ones that are allowed, in table order."""
        return tuple(m for m in auto_candidates() if m in self.allowed_modes)

    @property
    def concrete_modes(self) -> tuple[str, ...]:
        """The transfer modes ``mode`` stands for: itself, or for ``auto`` the modes it may pick."""
        return self.auto_modes if self.mode == AUTO_MODE else (self.mode,)

    @property
    def two_stream(self) -> bool:
        return any(get_mode(m).two_stream for m in self.concrete_modes)

    @property
    def codec_name(self) -> str:
        return get_mode(self.concrete_modes[0]).codec

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> LynxConfig:
        """Parse and validate; unknown keys are warned about, not silently ignored."""
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            logger.warning("LynxConnector: ignoring unknown kv_connector_extra_config keys %s (known: %s)",
                           unknown, sorted(known))
        kw: dict[str, Any] = {}
        if "mode" in extra:
            kw["mode"] = str(extra["mode"]).strip().lower()
        if not _is_null(extra.get("codec_options")):
            kw["codec_options"] = _as_codec_options(extra["codec_options"])
        if "link_gbps" in extra:
            gbps = _as_float("link_gbps", extra["link_gbps"], allow_none=True)
            if gbps is not None and gbps <= 0:
                raise LynxConfigError(f"link_gbps: must be > 0 (or null for unpaced), got {extra['link_gbps']!r}")
            kw["link_gbps"] = gbps
        for key, lo, hi in (("chunk_bytes", 4096, 1 << 31), ("window_bytes", 4096, 1 << 34),
                            ("staging_mb", 1, 1 << 20), ("side_channel_port", 0, 65535),
                            ("max_speculative_tokens", 0, 4096)):
            if key in extra:
                kw[key] = _as_int(key, extra[key], minimum=lo, maximum=hi)
        for key, lo in (("lease_s", 0.1), ("timeout_s", 0.1), ("speculative_min_margin", 0.0),
                        ("concurrent_wait_s", 1.0), ("max_stream_wait_s", 0.001), ("auto_window_s", 0.1),
                        ("idle_wait_s", 0.0), ("residual_grace_s", 0.0)):
            if key in extra:
                kw[key] = _as_float(key, extra[key], minimum=lo, allow_none=key == "lease_s")
        if "side_channel_host" in extra:  # null is no address (an empty $(POD_IP) in a template): refused
            host = extra["side_channel_host"]
            kw["side_channel_host"] = "" if _is_null(host) else bracketed(str(host).strip())
        if not _is_null(extra.get("status_dir")):
            kw["status_dir"] = str(extra["status_dir"])
        for key in ("insecure_side_channel", "report_speculation", "layerwise"):
            if key in extra:
                kw[key] = _as_bool(key, extra[key])
        if not _is_null(extra.get("auto_speculative")):
            kw["auto_speculative"] = _as_bool("auto_speculative", extra["auto_speculative"])
        if "transfer_order" in extra:
            kw["transfer_order"] = str(extra["transfer_order"]).strip().lower()
        if not _is_null(extra.get("allowed_modes")):
            kw["allowed_modes"] = _as_modes("allowed_modes", extra["allowed_modes"])
        if "params_ttl_s" in extra:
            kw["params_ttl_s"] = _as_float("params_ttl_s", extra["params_ttl_s"], minimum=1.0, allow_none=True)
        if not _is_null(extra.get("fault_injection")):
            kw["fault_injection"] = str(extra["fault_injection"])
        return cls(**kw)

    def transport_config(self, tp_rank: int, key: bytes | None, endpoint: str,
                         extra_keys: tuple[bytes, ...] = ()) -> TransportConfig:
        """The transport settings of one endpoint (``endpoint``: its name, for the status file) of the worker of
        tensor-parallel rank ``tp_rank``; a fixed side-channel port is offset by the rank."""
        from lynx_connector.transport.config import TransportConfig  # the transport package loads torch, zmq

        status = None
        if self.status_dir is not None:
            try:
                os.makedirs(self.status_dir, exist_ok=True)
            except OSError as e:
                raise LynxConfigError(f"status_dir: cannot create the folder {self.status_dir!r}: {e}") from None
            status = os.path.join(self.status_dir, endpoint + ".json")
        if self.side_channel_port and self.side_channel_port + tp_rank > 65535:
            raise LynxConfigError(f"side_channel_port: {self.side_channel_port} + tensor-parallel rank {tp_rank} is past "
                                  f"65535 (each rank listens on side_channel_port + its rank)")
        return TransportConfig(
            link_gbps=self.link_gbps, chunk_bytes=self.chunk_bytes, window_bytes=self.window_bytes,
            lease_s=self.effective_lease_s, timeout_s=self.timeout_s, host=self.side_channel_host,
            port=self.side_channel_port + tp_rank if self.side_channel_port else 0,
            pool_bytes=self.staging_mb << 20, key=key, extra_keys=extra_keys, status_path=status, order=self.transfer_order,
            max_wait_s=self.max_stream_wait_s)

    @property
    def effective_lease_s(self) -> float:
        """P's lease: ``lease_s``, or by default 120 s, lengthened to 1.25x the time a full pool takes to drain at
        ``link_gbps`` or to ``timeout_s`` when that is longer (the transport refuses a lease shorter than that drain
        time)."""
        if self.lease_s is not None:
            return self.lease_s
        from lynx_connector.transport.config import drain_seconds

        drain_s = drain_seconds(self.staging_mb << 20, self.link_gbps) or 0.0
        return max(DEFAULT_LEASE_S, float(math.ceil(1.25 * drain_s)), self.timeout_s)

    def describe(self) -> str:
        """One line for the start-up log."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))

