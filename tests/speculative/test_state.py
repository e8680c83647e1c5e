"""Bookkeeping of held tokens and verification passes (SpecState), without vLLM."""

from __future__ import annotations

from lynx_connector.speculative.state import Phase, SpecState


def _state(held: list[int]) -> SpecState:
    st = SpecState("r", held=list(held), speculated=len(held))
    st.phase = Phase.VERIFY
    return st


def test_single_pass_accepts_prefix_and_stops_at_first_mismatch() -> None:
    st = _state([5, 6, 7, 8])
    assert st.next_chunk(8) == [5, 6, 7, 8]
    st.scheduled = 4
    assert st.verified([5, 6, 9]) is False  # 2 accepted, target's 9 replaces 7
    assert (st.accepted, st.rejected, st.passes) == (2, 2, 1)


def test_all_accepted_with_bonus_beyond_the_held_tokens() -> None:
    st = _state([5, 6])
    st.next_chunk(8)
    st.scheduled = 2
    assert st.verified([5, 6, 11]) is False
    assert (st.accepted, st.rejected) == (2, 0)


def test_chunked_passes_continue_while_everything_agrees() -> None:
    st = _state(list(range(10)))
    assert st.next_chunk(4) == [0, 1, 2, 3]
    st.scheduled = 4
    assert st.verified([0, 1, 2, 3, 4]) is True  # bonus == held[4]: counted, next pass from held[5]
    assert st.next_chunk(4) == [5, 6, 7, 8]
    st.scheduled = 4
    assert st.verified([5, 6, 99]) is False
    assert (st.accepted, st.rejected, st.passes) == (7, 3, 2)


def test_fewer_drafts_scheduled_than_proposed() -> None:
    st = _state([1, 2, 3])
    st.next_chunk(3)
    st.scheduled = 0  # budget: only the last prompt token was computed
    assert st.verified([1]) is True and st.pos == 1
    st.next_chunk(3)
    st.scheduled = 2
    assert st.verified([2, 3, 4]) is False and st.accepted == 3


def test_cap_and_stop_make_the_request_wait() -> None:
    st = SpecState("r", held=[1, 2, 3])
    assert st.must_wait(3) and not st.must_wait(4)
    st.would_stop = True
    assert st.must_wait(4)
    st.phase = Phase.VERIFY
    assert not st.must_wait(1)


def test_a_pass_whose_bonus_is_the_last_held_token_ends_verification() -> None:
    """All drafts accepted and the target's token equals the last held token: every held token is accepted and
    nothing is left to verify, so verification is over (no empty further pass)."""
    st = _state([1, 2, 3])
    assert st.next_chunk(2) == [1, 2]
    st.scheduled = 2
    assert st.verified([1, 2, 3]) is False
    assert (st.pos, st.accepted, st.rejected, st.passes) == (3, 3, 0, 1)
