"""P's first token arriving after D's first token on the anchor (concurrent flow, issue 15): the real vLLM
scheduler with the real connector half and no model (``sched_harness``); the test plays the worker, which learns
P's token from P's side channel (``LynxWorkerMeta.first_tokens``) a step or more after D sampled its own.

Equal: the first held token is released in the step P's token arrives and committed (verification starts after
it); unequal: speculation stops (``first_token_mismatch``) and the verification pass decides. Either way the
released text is full-precision decoding. The real engines: tests/integration/test_pipelined_engines.py
(``test_pipelined_speculative_releases_p_first_token_on_the_anchor``)."""

from __future__ import annotations

import pytest

from tests.speculative.sched_harness import ANCHOR, FULL, Driver, make_scheduler

pytestmark = pytest.mark.timeout(120)

K, CAP = 4, 6


@pytest.fixture
def d(mc):
    return Driver(make_scheduler(mc, k=K, cap=CAP))


def clean(d: Driver) -> None:
    st = d.state()
    assert st["requests"] == [] and st["spec"] == [] and st["spec_pending"] == []
    assert st["free_blocks"] == d.free_at_start
    assert d.sched.connector.connector_scheduler.spec.first_token == {}


@pytest.mark.parametrize("late_steps", [0, 2])
def test_equal_token_arriving_later_releases_the_first_held_token(d, late_steps):
    d.add("r", 40, ANCHOR, FULL, max_tokens=10)  # concurrent flow: no lynx_first_token in the params
    d.load("r")
    for _ in range(late_steps):
        d.step()
        assert d.out["r"].tokens == [] and d.sched._spec["r"].awaits_first  # D's first token is held meanwhile
    d.step(first_tokens={"r": ANCHOR[0]})  # (late_steps 0: in the very step D sampled its first token)
    assert d.out["r"].tokens == [ANCHOR[0]]  # released in the step P's token arrived
    st = d.sched._spec["r"]
    assert st.committed == 1 and st.held == ANCHOR[1:late_steps + 1] and not st.awaits_first
    d.step()
    d.step(merged={"r"})
    d.step()  # recompute the last prompt token and the committed one, then verify the held tokens after it
    assert d.last.scheduled_spec_decode_tokens == {"r": ANCHOR[1:1 + min(K, late_steps + 2)]}
    out = d.run_until_done("r")
    assert out.tokens == FULL[:10]
    s = out.speculation
    assert s["first_token_early"] == 1 and s["first_token_mismatch"] == 0
    assert s["speculated"] == late_steps + 2 and s["accepted"] == 1
    clean(d)


def test_unequal_token_arriving_later_stops_speculation(d):
    d.add("r", 40, ANCHOR, FULL, max_tokens=8)
    d.load("r")
    d.step()
    d.step()
    d.step(first_tokens={"r": 999})  # P's full-precision first token is not D's: what follows would be rejected
    st = d.sched._spec["r"]
    assert d.out["r"].tokens == [] and st.stopped == "first_token_mismatch" and st.committed == 0
    d.step()
    assert d.last.num_scheduled_tokens == {}  # waits for the residual
    d.step(merged={"r"})
    out = d.run_until_done("r")
    assert out.tokens == FULL[:8]  # the verification pass decides every token, the first included
    s = out.speculation
    assert (s["first_token_early"], s["first_token_mismatch"], s["speculated"]) == (0, 1, 3)
    clean(d)


def test_sampled_request_never_releases_early(d):
    d.add("r", 40, ANCHOR, ANCHOR, max_tokens=6, temperature=1.0)
    d.load("r")
    d.step()
    assert not d.sched._spec["r"].awaits_first
    d.step(first_tokens={"r": ANCHOR[0]})
    assert d.out["r"].tokens == []  # its output distribution must stay the full-precision one: held
    d.step(merged={"r"})
    out = d.run_until_done("r")
    assert len(out.tokens) == 6 and out.speculation["first_token_early"] == 0
    clean(d)


def test_first_token_whose_stop_fires_is_left_to_verification(d):
    d.add("r", 40, ANCHOR, FULL, max_tokens=1)
    d.load("r")
    d.step()  # held; its stop probe fires (max_tokens 1): decoding on the anchor ends
    d.step(first_tokens={"r": ANCHOR[0]})
    assert d.out["r"].tokens == [] and d.out["r"].finish_reason is None
    d.step(merged={"r"})
    out = d.run_until_done("r")
    assert out.tokens == FULL[:1] and out.finish_reason == "length"
    assert out.speculation["first_token_early"] == 0
    clean(d)


def test_token_after_the_residual_is_ignored(d):
    d.add("r", 40, ANCHOR, FULL, max_tokens=8)
    d.load("r")
    d.step()
    d.step(merged={"r"})
    d.step(first_tokens={"r": ANCHOR[0]})  # verifying already: the pass decides, P's token is not needed
    out = d.run_until_done("r")
    assert out.tokens == FULL[:8] and out.speculation["first_token_early"] == 0
    clean(d)
