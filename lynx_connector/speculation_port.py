"""The connector's scheduler half as D's speculative scheduler sees it (``LynxSpecScheduler``,
lynx_connector/speculative/scheduler.py): `SpeculationPort` is the whole interface between the two, obtained
with :func:`speculation_port`; the base halves import nothing from the speculative package."""

from __future__ import annotations

from collections.abc import Set
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lynx_connector.scheduler import LynxConnectorScheduler

__all__ = ["SpeculationPort", "speculation_port"]


class SpeculationPort:
    """The connector's scheduler half as the speculative scheduler (D, ``LynxSpecScheduler``) sees it: the whole
    interface between the two. Obtained with :func:`speculation_port`; ``enable()`` turns speculative pulls on
    (without it a ``speculative`` request is served as ``full``)."""

    def __init__(self, half: LynxConnectorScheduler) -> None:
        self._half = half

    @property
    def max_speculative_tokens(self) -> int:
        return self._half.config.max_speculative_tokens

    @property
    def speculative_min_margin(self) -> float:
        return self._half.config.speculative_min_margin

    @property
    def report_speculation(self) -> bool:
        return self._half.config.report_speculation

    def enable(self) -> None:
        self._half.speculation_enabled = True

    def pending(self) -> Set[str]:
        """Requests pulled in speculative mode whose residual is still to be merged (read-only view)."""
        return self._half.spec.pending

    def take_residual_merged(self) -> set[str]:
        """Requests whose residual was merged since the last call."""
        return self._half.spec.take_merged()

    def take_residual_failed(self) -> set[str]:
        """Requests whose residual failed after their anchor was reported ready, since the last call."""
        return self._half.spec.take_failed()

    def take_first_token(self, req_id: str) -> int | None:
        """The token P sampled after the prompt of ``req_id`` (once; None when P sent none)."""
        return self._half.spec.first_token.pop(req_id, None)

    def cancel_residual(self, req_id: str) -> bool:
        """``req_id`` is preempted (its blocks are freed in this step): cancel its pull silently. True when a pull
        was still pending."""
        return self._half.cancel_residual(req_id)


def speculation_port(connector: Any) -> SpeculationPort | None:
    """The speculation interface of a vLLM scheduler's connector, None unless it is a LynxConnector's."""
    from lynx_connector.scheduler import LynxConnectorScheduler

    half = getattr(connector, "connector_scheduler", None)
    return SpeculationPort(half) if isinstance(half, LynxConnectorScheduler) else None
