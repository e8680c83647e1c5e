"""Per-request state of decode-on-anchor speculation (pure data, no vLLM import)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Phase(enum.Enum):
    #: Decoding on the anchor: sampled tokens are held (not released, no stop check).
    ANCHOR = "anchor"
    #: Residual merged, request rewound: the held tokens are being verified as draft tokens.
    VERIFY = "verify"


@dataclass
class SpecState:
    req_id: str
    phase: Phase = Phase.ANCHOR
    #: The token P sampled after the prompt at full precision (from kv_transfer_params), if usable here.
    prefill_token: int | None = None
    #: Concurrent flow: the request may release P's first token but it is not known yet (it comes from P's side
    #: channel, possibly after D's first token on the anchor, which is then held until it comes).
    awaits_first: bool = False
    #: The stop probe fired on the first held token (releasing it would finish the request).
    first_would_stop: bool = False
    #: Output tokens released before verification: 1 when D's first token on the anchor equals P's token
    #: (P's token is full-precision decoding, so it is released at once, or when P's token arrives;
    #: verification starts after it).
    committed: int = 0
    #: Tokens sampled on the anchor, in order (never sent to the client before verification).
    held: list[int] = field(default_factory=list)
    #: A stop condition (EOS, stop token, max_tokens, max_model_len) fired on a held token: decode no further.
    would_stop: bool = False
    #: Why decoding on the anchor ended before the cap without holding the latest token: "low_margin" (the
    #: anchor's top two logits were too close) or "first_token_mismatch" (D's first token on the anchor is not
    #: P's full-precision token, so whatever follows it would be rejected).
    stopped: str | None = None
    #: VERIFY: index in ``held`` of the first token not verified yet, and the drafts of the pending pass.
    pos: int = 0
    chunk: list[int] = field(default_factory=list)
    #: VERIFY: number of drafts vLLM actually scheduled for the pending pass (None: not scheduled yet).
    scheduled: int | None = None
    #: Counters: tokens decoded on the anchor, verified equal, verify passes, steps spent waiting at the cap.
    speculated: int = 0
    accepted: int = 0
    passes: int = 0
    capped_steps: int = 0
    #: Preempted while speculating: the held tokens were dropped and the request recomputed at full precision.
    preempted: bool = False
    #: Held tokens dropped before verification reached them (preempted, the residual failed, or the request
    #: finished first): neither accepted nor rejected.
    dropped: int = 0

    @property
    def rejected(self) -> int:
        return self.speculated - self.accepted - self.dropped

    def drop_unverified(self) -> int:
        """The held tokens verification has not reached are dropped; returns how many."""
        self.dropped = len(self.held) - self.pos
        return self.dropped

    def must_wait(self, cap: int) -> bool:
        """Not to be scheduled this step: decoding on the anchor is capped or has reached a stop."""
        return self.phase is Phase.ANCHOR and (self.would_stop or self.stopped is not None or len(self.held) >= cap)

    @property
    def decoded_on_anchor(self) -> bool:
        """D computed at least one step on the anchor (so the last prompt token must be recomputed)."""
        return bool(self.held or self.committed or self.stopped)

    def next_chunk(self, k: int) -> list[int]:
        self.chunk = self.held[self.pos:self.pos + k]
        self.scheduled = None
        return self.chunk

    def verified(self, out: list[int]) -> bool:
        """Record the outcome of one verification pass (``out``: accepted drafts + the target's token).

        Returns True when verification continues with another pass (every draft of the pass was accepted and
        the target's token equals the next held token), False when it is over."""
        n = self.scheduled if self.scheduled is not None else len(self.chunk)
        self.passes += 1
        ok = len(out) - 1  # drafts accepted in this pass
        nxt = self.pos + n
        if ok == n and nxt < len(self.held) and out[-1] == self.held[nxt]:
            self.accepted += n + 1
            self.pos = nxt + 1
            return self.pos < len(self.held)
        self.accepted += ok
        self.pos = len(self.held)
        return False

    def summary(self) -> dict[str, int]:
        return {"speculated": self.speculated, "accepted": self.accepted, "rejected": self.rejected,
                "dropped": self.dropped,
                "verify_passes": self.passes, "capped_steps": self.capped_steps,
                "first_token_early": self.committed, "preempted": int(self.preempted),
                "stopped_low_margin": int(self.stopped == "low_margin"),
                "first_token_mismatch": int(self.stopped == "first_token_mismatch")}
