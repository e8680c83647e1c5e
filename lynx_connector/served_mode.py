"""D: the mode a pull is served as (`ServedMode`, a part of `LynxConnectorScheduler`). A speculative mode needs the
Lynx speculative scheduler; without it, and for requests speculation must not serve, the modes table's fallback
(full) is served instead."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lynx_connector.config import LynxConfig
from lynx_connector.logger import init_logger
from lynx_connector.modes import get_mode

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["ServedMode"]


class ServedMode:
    """The served-mode choice of D's scheduler half (a mixin: it works on the scheduler's attributes)."""

    config: LynxConfig
    speculation_enabled: bool
    _warned_no_spec: bool

    def _auto_served(self, request: Request) -> str:
        """D, auto in the concurrent flow: the mode a Lynx choice of P's is served as (speculative when this D
        can, else full; the passthrough when D allows no Lynx mode). Until P names its choice the request is
        treated as this mode: a provisional speculative one is fenced from the prefix cache and pending its
        residual; P choosing the passthrough lifts the latter (``update_connector_output``)."""
        allowed = self.config.auto_modes
        if "speculative" in allowed:
            return self._decode_mode(request, "speculative")
        return "full" if "full" in allowed else allowed[0]

    def _decode_mode(self, request: Request, mode: str) -> str:
        """D's mode for a pull: speculation needs the Lynx scheduler, otherwise the request is served as its
        mode's fallback (the modes table: full). Structured-output requests are served as the fallback too (held
        tokens would bypass the grammar), and so are seeded sampled ones: speculation samples from the right
        distribution, but its draws depend on when the residual lands, so a seed would not give the same text twice.
        Requests with ``min_tokens`` as well: vLLM's min-tokens processor stops masking the stop tokens of a request
        once its output (held tokens included) reaches ``min_tokens``, and a request verified without leaving the
        batch is never tracked again, so verification would let it stop too early."""
        row = get_mode(mode)
        if not row.needs_spec_scheduler:
            return mode
        fallback = row.fallback
        assert fallback is not None  # the table gives every speculative mode one (tests/test_modes.py)
        req_id = request.request_id
        if request.use_structured_output:
            logger.debug("Request %s uses structured output: served as '%s' instead of '%s'", req_id, fallback, mode)
            return fallback
        if _seeded(request):
            logger.debug("Request %s samples with a seed: served as '%s' instead of '%s' (reproducible)", req_id,
                        fallback, mode)
            return fallback
        if _min_tokens(request):
            logger.debug("Request %s sets min_tokens: served as '%s' instead of '%s' (vLLM's min-tokens mask would "
                         "miss its verification pass)", req_id, fallback, mode)
            return fallback
        if self.speculation_enabled:
            return mode
        if not self._warned_no_spec:
            self._warned_no_spec = True
            logger.warning("Request %s asks for lynx_mode %s but this decode instance runs without the "
                           "Lynx speculative scheduler (--scheduler-cls %s with a custom_class speculative "
                           "config; the lynx:speculative preset sets both): serving it and the next ones as "
                           "'%s'", req_id, mode, "lynx_connector.speculative.scheduler.LynxSpecScheduler",
                           fallback)
        return fallback


def _seeded(request: Request) -> bool:
    """The request samples with a seed (``temperature > 0`` and ``seed`` set: vLLM's RANDOM_SEED)."""
    from vllm.sampling_params import SamplingType

    sp = getattr(request, "sampling_params", None)
    return sp is not None and sp.sampling_type == SamplingType.RANDOM_SEED


def _min_tokens(request: Request) -> bool:
    """The request sets ``min_tokens`` (vLLM's MinTokensLogitsProcessor masks its stop tokens until then)."""
    sp = getattr(request, "sampling_params", None)
    return sp is not None and (sp.min_tokens or 0) > 0
