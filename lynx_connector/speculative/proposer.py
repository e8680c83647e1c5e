"""A proposer that proposes nothing (``speculative_config.method = "custom_class"``).

Its only job is to switch vLLM's verification machinery on: with a speculative config vLLM builds the
``RejectionSampler``, schedules ``spec_token_ids`` as draft tokens and rolls rejected positions back. The
drafts themselves come from :class:`lynx_connector.speculative.scheduler.LynxSpecScheduler` (the tokens decoded on
the anchor), never from this class. Choosing ``custom_class`` also forces Model Runner V1 and synchronous
scheduling, which the scheduler relies on (MRV2 ignores scheduler-provided draft values).
"""

from __future__ import annotations

from typing import Any


class NullProposer:
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        self.vllm_config = vllm_config

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's CPU model runner calls ``drafter.load_model(model)`` for every drafter; nothing to load."""
        return None

    def propose(self, sampled_token_ids: list[Any], *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]
