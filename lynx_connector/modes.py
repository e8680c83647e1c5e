"""The transfer modes, in one table: what each mode pulls, when D decodes, when the first token may be released,
whether D's prefix cache keeps its blocks, whether it is lossless, and what it costs on the wire.

Every consumer asks this table (config and presets validate against it, the scheduler and worker halves follow
its rules, the wire params are checked against it, the benches and the docs read it); there is no other list of
mode names. Pure data: importing it imports neither torch nor vLLM (the wire-cost helpers import the codec
registry when called), so the presets can use it in every vLLM process.

Planes: a two-stream codec (``lynx``) splits every value into an ``anchor`` and a ``residual`` plane; a
single-stream codec (the baselines) puts everything in the anchor plane and has an empty residual. P always
encodes the planes its codec has; the mode decides what D pulls and when it decodes.

Prefix cache: vLLM caches a request's loaded blocks under the prompt's token hashes once the load is reported
finished (``cache_blocks`` in ``_update_waiting_for_remote_kv``, and again as the request runs), when prefix caching
is on. D enters loaded blocks into its prefix cache only for the modes whose KV is at full precision when the
request is reported ready (:attr:`TransferMode.prefix_cached`: ``full`` and ``bf16``); for every other mode the
scheduler half gives the request's blocks private hashes (``lynx_connector/prefix_cache.py``), so no later request
is served from lossy KV. ``speculative`` reports its request ready on the anchor (lossy) and merges the residual
later, so its blocks are never cached either (its scheduler also turns prefix caching off on the instance).

Allowed modes: which modes a client may ask for is an operator setting (``allowed_modes``); the default is
:func:`default_allowed_modes`, the full-precision modes (lossless, or Lynx with both planes merged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lynx_connector.codec import Codec

#: The two-stream codec of the Lynx modes (``lynx_connector.codec.get_codec`` name).
LYNX_CODEC = "lynx"
#: Plane names (the transport's stream names).
ANCHOR, RESIDUAL = "anchor", "residual"
#: ``decode_after`` values: D writes the prompt's KV and may decode once the anchor has landed, or once both
#: planes have landed and are merged.
AFTER_ANCHOR, AFTER_BOTH = "anchor", "both"
#: ``first_token_after`` values: on the anchor (P's first token, released when D's first token on the anchor
#: agrees with it) or with the KV D decodes on (the planes of ``decode_after``).
RELEASE_ON_ANCHOR, RELEASE_WITH_KV = "anchor", "kv"


class UnknownModeError(ValueError):
    """A name that is not a transfer mode; the message lists the valid ones."""


@dataclass(frozen=True)
class TransferMode:
    """One transfer mode (a row of :data:`MODES`)."""

    name: str
    #: The codec's name in ``lynx_connector.codec.get_codec`` (``lynx`` for the three Lynx modes).
    codec: str
    #: Whether that codec splits values into anchor and residual planes (P encodes both).
    two_stream: bool
    #: The planes D pulls, in order.
    planes: tuple[str, ...]
    #: When D writes the prompt's KV into its blocks and the request may decode: AFTER_ANCHOR or AFTER_BOTH.
    decode_after: str
    #: When the first client-visible token may be released: RELEASE_ON_ANCHOR or RELEASE_WITH_KV.
    first_token_after: str
    #: Whether D's blocks end up bit-identical to P's (the cache dtype's bytes), when D's cache dtype holds every
    #: value of P's (the same dtype, or bf16/fp16 P -> fp32 D); a narrower D rounds once on write (compat.py).
    lossless: bool
    #: Whether D needs the Lynx speculative scheduler (``--scheduler-cls``; the ``lynx:speculative`` preset).
    needs_spec_scheduler: bool
    #: The mode a request is served as when D cannot serve this one (no speculative scheduler, structured
    #: output); None when it is always served as itself.
    fallback: str | None
    #: What D does, one line (docs, help).
    summary: str
    #: Short name in tables and plots.
    label: str

    @property
    def pulls_residual(self) -> bool:
        return RESIDUAL in self.planes

    @property
    def decodes_on_anchor(self) -> bool:
        """D writes the KV (and the request runs) as soon as the anchor plane has landed."""
        return self.decode_after == AFTER_ANCHOR

    @property
    def full_precision(self) -> bool:
        """D's blocks end at full precision: lossless, or both Lynx planes merged (error <= s/32)."""
        return self.lossless or (self.two_stream and self.pulls_residual)

    @property
    def prefix_cached(self) -> bool:
        """D enters the blocks it loaded into its prefix cache: only when they are at full precision the moment
        the request is reported ready (a late residual reports it on the anchor; see the module docstring)."""
        return self.full_precision and not self.late_residual

    @property
    def late_residual(self) -> bool:
        """D decodes on the anchor and merges the residual into the same blocks later (speculative): the
        request is reported ready before its pull is over, and the merge (or its failure) is signalled apart."""
        return self.decodes_on_anchor and self.pulls_residual

    @property
    def pull_order(self) -> str:
        """How D's transfer scheduler ranks this mode's streams against other requests'
        (``lynx_connector/transport/ranking.py``): ``split`` when the anchor alone unblocks output and the residual
        comes later (speculative), else ``whole`` (nothing comes out before every plane D pulls has landed)."""
        return "split" if self.late_residual else "whole"

    # ---- wire cost (the codec's plane_nbytes; no arithmetic of its own) -----------------------------------
    def plane_nbytes(self, num_tokens: int, num_heads: int, head_size: int, cache_dtype: torch.dtype,
                     codec: Codec | None = None) -> tuple[int, int]:
        """Bytes of one layer's (anchor, residual) planes that D pulls: the codec's ``plane_nbytes``, the
        residual 0 when this mode does not pull it. ``codec``: an instance of :attr:`codec` built with options
        (default: the registry's defaults)."""
        if codec is None:
            from lynx_connector.codec import get_codec

            codec = get_codec(self.codec)
        a, r = codec.plane_nbytes(num_tokens, num_heads, head_size, cache_dtype)
        return a, (r if self.pulls_residual else 0)

    def wire_nbytes(self, num_tokens: int, num_heads: int, head_size: int, cache_dtype: torch.dtype,
                    codec: Codec | None = None) -> tuple[int, int]:
        """One layer's ``(bytes that must land before the first token may be released, bytes D pulls)``."""
        a, r = self.plane_nbytes(num_tokens, num_heads, head_size, cache_dtype, codec)
        return (a if self.first_token_after == RELEASE_ON_ANCHOR else a + r), a + r

    def bits_per_value(self, num_tokens: int, num_heads: int, head_size: int, cache_dtype: torch.dtype,
                       codec: Codec | None = None) -> float:
        """Wire bits per K/V value D pulls (metadata included)."""
        pulled = self.wire_nbytes(num_tokens, num_heads, head_size, cache_dtype, codec)[1]
        return 8.0 * pulled / (2 * num_tokens * num_heads * head_size)


def _lynx(name: str, planes: tuple[str, ...], decode_after: str, summary: str, *, label: str,
          first_token_after: str = RELEASE_WITH_KV, needs_spec_scheduler: bool = False,
          fallback: str | None = None) -> TransferMode:
    return TransferMode(name=name, codec=LYNX_CODEC, two_stream=True, planes=planes, decode_after=decode_after,
                        first_token_after=first_token_after, lossless=False,
                        needs_spec_scheduler=needs_spec_scheduler, fallback=fallback, summary=summary, label=label)


def _baseline(codec: str, summary: str, lossless: bool = False, label: str | None = None) -> TransferMode:
    return TransferMode(name=codec, codec=codec, two_stream=False, planes=(ANCHOR,), decode_after=AFTER_ANCHOR,
                        first_token_after=RELEASE_WITH_KV, lossless=lossless,
                        needs_spec_scheduler=False, fallback=None, summary=summary, label=label or codec)


#: The table, in the order of the docs and help texts: the Lynx modes, then the single-stream baselines.
MODES: tuple[TransferMode, ...] = (
    _lynx("full", (ANCHOR, RESIDUAL), AFTER_BOTH, "waits for anchor and residual, merges, decodes",
          label="lynx full"),
    _lynx("anchor", (ANCHOR,), AFTER_ANCHOR,
          "decodes on the anchor alone (lossy, for comparison); the residual is never pulled", label="lynx anchor"),
    _lynx("speculative", (ANCHOR, RESIDUAL), AFTER_ANCHOR,
          "decodes on the anchor, holds those tokens, verifies them in one pass when the residual lands "
          "(outputs equal full's; preempted while holding: exact, see \"Preemption on D\")",
          first_token_after=RELEASE_ON_ANCHOR, needs_spec_scheduler=True, fallback="full",
          label="lynx speculative"),
    _baseline("bf16", "single-stream passthrough of the cache dtype's bytes", lossless=True),
    _baseline("fp8", "single-stream baseline: fp8 e4m3 with a per-(token, head) scale"),
    _baseline("int8", "single-stream baseline: 8-bit per (token, head)"),
    _baseline("int4", "single-stream baseline: 4-bit per (token, head)"),
    _baseline("int4_kivi", "single-stream baseline: 4-bit, K per channel over 64 tokens, V per token (KIVI)",
              label="int4 KIVI"),
)

_BY_NAME: dict[str, TransferMode] = {m.name: m for m in MODES}
#: Every mode name, in table order.
MODE_NAMES: tuple[str, ...] = tuple(_BY_NAME)
#: The modes of the Lynx codec (two streams) and the single-stream baselines.
LYNX_MODE_NAMES: tuple[str, ...] = tuple(m.name for m in MODES if m.two_stream)
BASELINE_MODE_NAMES: tuple[str, ...] = tuple(m.name for m in MODES if not m.two_stream)
DEFAULT_MODE = "full"


#: Not a transfer mode but a per-request choice among :func:`auto_candidates` (``lynx_connector/auto.py``): P
#: picks one when the request is scheduled and D learns it from the signed params (``lynx_mode``).
AUTO_MODE = "auto"


def auto_candidates() -> tuple[str, ...]:
    """The modes ``auto`` chooses among: the full-precision ones (lossless passthrough, Lynx full, Lynx
    speculative), never a lossy one (4-bit, fp8, int8, anchor), in table order."""
    return default_allowed_modes()


def is_requestable(name: object) -> bool:
    """A transfer mode or ``auto``: what ``mode``, ``allowed_modes`` and a request's ``lynx_mode`` may name."""
    return is_mode(name) or name == AUTO_MODE


def is_mode(name: object) -> bool:
    return isinstance(name, str) and name in _BY_NAME


def get_mode(name: str) -> TransferMode:
    """The row of ``name``; :class:`UnknownModeError` (a ValueError) listing the valid modes otherwise."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise UnknownModeError(f"unknown transfer mode {name!r}; valid modes: {', '.join(MODE_NAMES)}") from None


def default_allowed_modes() -> tuple[str, ...]:
    """The modes clients may ask for when the operator sets no ``allowed_modes``: the full-precision ones
    (lossless, or Lynx with both planes: ``full``, ``speculative``, ``bf16``), in table order."""
    return tuple(m.name for m in MODES if m.full_precision)


def preset_modes() -> tuple[str, ...]:
    """The modes ``--kv-transfer-config lynx:<mode>`` accepts: every mode of the table (``lynx:int4_kivi``
    included, which the hand-written preset list once missed), and ``auto``."""
    return (*MODE_NAMES, AUTO_MODE)


def comparison_order() -> tuple[str, ...]:
    """The modes as the benches and reports compare them: the single-stream baselines (table order), then the
    Lynx modes from the least D waits for to the most machinery (anchor, full, speculative)."""
    def key(name: str) -> tuple[bool, bool, bool]:
        m = _BY_NAME[name]
        return m.two_stream, m.pulls_residual, m.needs_spec_scheduler

    return tuple(sorted(MODE_NAMES, key=key))  # stable: table order within a group


def modes_table() -> str:
    """The table as Markdown (docs/OPERATIONS.md; generated by ``python -m lynx_connector.lab.docgen``).
    Wire bits per value at the codecs' default grouping, for 1024 tokens, 8 KV heads of 128, a bf16 cache."""
    import torch

    rows = ["| mode | codec | D pulls | D decodes after | first token released | D's prefix cache keeps blocks "
            "| lossless | allowed by default | needs the speculative scheduler | wire bits/value (bf16 cache) "
            "| what D does |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    allowed = default_allowed_modes()
    for m in MODES:
        bits = m.bits_per_value(1024, 8, 128, torch.bfloat16)
        after = "anchor" if m.decodes_on_anchor else "anchor + residual"
        first = "on the anchor (P's token)" if m.first_token_after == RELEASE_ON_ANCHOR else "with the KV"
        cached = "yes" if m.prefix_cached else "no"
        needs = "yes" if m.needs_spec_scheduler else "no"
        fallback = (f"; served as `{m.fallback}` without it, and for structured-output, seeded sampled or `min_tokens` requests"
                    if m.fallback else "")
        rows.append(f"| `{m.name}` | `{m.codec}` | {' + '.join(m.planes)} | {after} | {first} | {cached} "
                    f"| {'yes' if m.lossless else 'no'} | {'yes' if m.name in allowed else 'no'} | {needs}{fallback} | {bits:.4g} | {m.summary} |")
    return "\n".join(rows)
