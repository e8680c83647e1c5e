"""Requests vLLM splits into children (n > 1): each D child pulls its own P child's staging
(``lynx_connector/fanout.py``); a child (or any D request) that ends before its pull started frees P's staging
at once, not at P's lease. Scheduler halves with the small fakes of test_scheduler_half, then both halves
with the real worker, codec and transport over the fake NIXL of test_worker_fake_nixl. The real engines run in
tests/integration/test_fanout_engines.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from vllm.v1.request import RequestStatus

from lynx_connector.codec import KVLayout
from lynx_connector.fanout import CHILDREN_KEY, SiblingBook, child_of
from lynx_connector.metadata import (
    InvalidTransferParams,
    LynxConnectorMetadata,
    LynxHandshakeMetadata,
    RemotePrefill,
)
from tests.connector.test_scheduler_half import FakeBlocks, make_sched, remote_params, req, sched_out
from tests.connector.test_worker_fake_nixl import (  # noqa: F401  (pair is a fixture)
    BS,
    D_BLOCKS,
    P_BLOCKS,
    N,
    expected,
    pair,
    poll_until,
    publish,
    recv_spec,
    results_until,
)

PARENT = "cmpl-3f2a-1a2b3c4d"  # vLLM's internal id: the external id plus 8 random characters


def test_child_ids_are_vllms():
    assert child_of(f"0_{PARENT}") == (0, PARENT)
    assert child_of(f"12_{PARENT}") == (12, PARENT)
    for other in (PARENT, "p-1", "_x", "01_x", "1x_y", "1_"):
        assert child_of(other) is None, other


def test_the_last_child_lists_every_sibling_and_groups_expire():
    book = SiblingBook(keep_s=10.0)
    assert book.add("p-1", {"lynx_transfer_id": "t"}, now=0.0) is None and len(book) == 0
    first = book.add(f"1_{PARENT}", {"remote_request_id": f"1_{PARENT}", "lynx_transfer_id": "t1", "x": 0}, now=1.0)
    assert first == [{"child": 1, "remote_request_id": f"1_{PARENT}", "lynx_transfer_id": "t1"}]
    last = book.add(f"0_{PARENT}", {"remote_request_id": f"0_{PARENT}", "lynx_transfer_id": "t0"}, now=2.0)
    assert [(e["child"], e["lynx_transfer_id"]) for e in last] == [(1, "t1"), (0, "t0")]
    book.add("0_other-00000000", {}, now=5.0)
    assert len(book) == 2
    book.add("1_other-00000000", {}, now=11.5)  # PARENT's group is past keep_s (P's lease): gone
    assert len(book) == 1


def p_children(s, mgr, n: int, prompt: int = 70):
    """P's scheduler half serving the n children vLLM made of one request: the params of each, in the order
    they finished (the last one's reach the response)."""
    reqs = [req(f"{i}_{PARENT}", prompt, {"do_remote_decode": True}) for i in range(n)]
    for r in reqs:
        mgr.blocks[r.request_id] = [7, 3, 9]
        s.update_state_after_alloc(r, FakeBlocks([7, 3, 9]), 0)
    meta = s.build_connector_meta(sched_out(**{r.request_id: prompt for r in reqs}))
    tickets = {x.req_id: (x.transfer_id, x.token) for x in meta.reqs_to_save}
    out = []
    for i, r in enumerate(reversed(reqs)):  # any order: the one that finishes last lists all
        r.status, r.output_token_ids, r.num_output_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, [100 + i], 1
        out.append(s.request_finished(r, [7, 3, 9])[1])
    return out, tickets


@pytest.mark.parametrize("shared_dict", [False, True])
def test_each_d_child_pulls_its_own_p_child(shared_dict):
    p, mgr = make_sched()
    answers, tickets = p_children(p, mgr, 3)
    assert len(answers[0][CHILDREN_KEY]) == 1 and len(answers[-1][CHILDREN_KEY]) == 3
    final = answers[-1]
    d, _ = make_sched()
    # Over vLLM's engine-core client every child gets its own copy of the params; in-process (the lab's
    # EngineProcess) the children share one dict, which D must not spoil for the siblings.
    dicts = [final] * 3 if shared_dict else [copy.deepcopy(final) for _ in range(3)]
    children = [req(f"{i}_cmpl-d-99999999", 70, dicts[i]) for i in range(3)]
    specs = []
    for c in children:
        assert d.get_num_new_matched_tokens(c, 0) == (70, True)
        d.update_state_after_alloc(c, FakeBlocks([1, 2, 4]), 70)
        specs += d.build_connector_meta(sched_out()).reqs_to_recv
    got = {s.req_id.split("_")[0]: (s.remote_req_id, (s.transfer_id, s.token)) for s in specs}
    assert got == {str(i): (f"{i}_{PARENT}", tickets[f"{i}_{PARENT}"]) for i in range(3)}
    assert len({s.transfer_id for s in specs}) == 3  # every P staging pulled exactly once
    assert all(c.kv_transfer_params["do_remote_prefill"] is False for c in children)  # pulled once each
    # the first token P sampled for that child (speculative mode) comes from the child's own entry
    first = {e["child"]: e["lynx_first_token"] for e in final[CHILDREN_KEY]}
    assert first == {2: 100, 1: 101, 0: 102}


def test_a_child_p_did_not_serve_is_computed_locally(caplog):
    p, mgr = make_sched()
    answers, _ = p_children(p, mgr, 2)
    params = answers[-1]
    params[CHILDREN_KEY] = [e for e in params[CHILDREN_KEY] if e["child"] == 0]  # P's child 1 was aborted
    params = p._signer.sign(params)  # as P would have signed that list (changing a signed list is refused)
    d, _ = make_sched()
    c1 = req(f"1_{PARENT}", 70, copy.deepcopy(params))
    with caplog.at_level(logging.WARNING):
        assert d.get_num_new_matched_tokens(c1, 0) == (0, False)
    assert "no KV for child 1" in caplog.text and "lists children [0]" in caplog.text
    c0 = req(f"0_{PARENT}", 70, copy.deepcopy(params))
    assert d.get_num_new_matched_tokens(c0, 0) == (70, True)
    # a request that is not a child uses the top level
    assert RemotePrefill.from_params(params, "cmpl-x").transfer_id == params["lynx_transfer_id"]


@pytest.mark.parametrize("bad", ["x", [], [{"child": "0"}], [{"child": True}], [{"child": 0, "remote_host": "evil"}],
                                 [{"child": i} for i in range(1025)]])
def test_malformed_children_lists_are_refused(bad):
    """D refuses a malformed list whoever made it: from_params on its own (what a key holder could still sign), and
    P's signer refuses to sign the ones that are not flat lists of scalars."""
    params = remote_params()
    params[CHILDREN_KEY] = bad
    with pytest.raises(InvalidTransferParams, match=CHILDREN_KEY):
        RemotePrefill.from_params(params, "0_x")


def test_fanout_end_to_end_over_the_transport(pair):  # noqa: F811  (the fixture imported above)
    """P's halves stage both children of an n=2 request; D's halves pull each child's own staging with the
    params of P's answer; both children's blocks hold P's KV, and every staging on P and D is freed by the
    children's Dones (no lease)."""
    make, _ = pair
    (pw, p_caches), (dw, d_caches) = make("kv_producer"), make("kv_consumer")
    host, port = pw.source.address
    ps, mgr = make_sched()
    ps.block_size = BS
    ps.set_handshake({0: LynxHandshakeMetadata(host=host, port=port, tp_rank=0)})
    reqs = [req(f"{i}_{PARENT}", N, {"do_remote_decode": True}) for i in range(2)]
    for r in reqs:
        mgr.blocks[r.request_id] = P_BLOCKS
        ps.update_state_after_alloc(r, FakeBlocks(P_BLOCKS), 0)
    pw.save(ps.build_connector_meta(sched_out(**{r.request_id: N for r in reqs})))
    assert pw.source.stats()["regions_live"] == 4  # anchor + residual of each child
    answer = None
    for r in reqs:
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        answer = ps.request_finished(r, P_BLOCKS)[1]
    ds, _ = make_sched()
    ds.block_size = BS
    kids = [req(f"{i}_cmpl-d-99999999", N, copy.deepcopy(answer)) for i in range(2)]
    blocks = {kids[0].request_id: D_BLOCKS, kids[1].request_id: [0, 1, 2]}
    for k in kids:
        assert ds.get_num_new_matched_tokens(k, 0) == (N, True)
        ds.update_state_after_alloc(k, FakeBlocks(blocks[k.request_id]), N)
    dw.start_load(ds.build_connector_meta(sched_out()))
    ids = set(blocks)
    done, failed = results_until([pw, dw], dw, lambda done, failed: ids <= done)
    assert failed == set()
    want = expected(p_caches, "full", full=True)  # P's KV through the codec, in D_BLOCKS
    layout = KVLayout.from_kv_cache(next(iter(d_caches.values())), block_size=BS, backend="cpu")
    for name, kv in d_caches.items():
        ref = layout.gather(want[name], D_BLOCKS, N)
        for k in kids:
            got = layout.gather(kv, blocks[k.request_id], N)
            assert all(torch.equal(g, w) for g, w in zip(got, ref, strict=True)), (name, k.request_id)
    poll_until([pw, dw], lambda: pw.source.stats()["regions_live"] == 0)
    assert dw.sink.pool.regions_live == 0 and dw._recvs == {}


# ---- a load that will never be pulled frees P's staging now (a Done), not at the lease -------------------------

def test_a_d_request_that_ends_unscheduled_frees_ps_staging():
    """D: a child aborted while waiting in vLLM's queue (its client left) never reached update_state_after_alloc;
    request_finished hands the worker an empty load for its transfer, which the worker turns into a Done."""
    p, mgr = make_sched()
    final = p_children(p, mgr, 2)[0][-1]
    d, _ = make_sched()
    kids = [req(f"{i}_cmpl-d-99999999", 70, copy.deepcopy(final), status=RequestStatus.FINISHED_ABORTED)
            for i in range(2)]
    d.get_num_new_matched_tokens(kids[0], 0)
    d.update_state_after_alloc(kids[0], FakeBlocks([1, 2, 4]), 70)
    d.build_connector_meta(sched_out())
    d.update_connector_output(type("O", (), {"finished_recving": {kids[0].request_id},
                                             "kv_connector_worker_meta": None})())
    assert d.request_finished(kids[0], [1, 2, 4]) == (False, None)  # pulled: nothing more to free
    assert d.request_finished(kids[1], []) == (False, None)  # never scheduled
    (spec,) = d.build_connector_meta(sched_out()).reqs_to_recv
    entry = next(e for e in final[CHILDREN_KEY] if e["child"] == 1)
    assert (spec.req_id, spec.num_tokens, spec.block_ids) == (kids[1].request_id, 0, [])
    assert (spec.transfer_id, spec.token) == (entry["lynx_transfer_id"], entry["lynx_token"])
    assert d.build_connector_meta(sched_out()).reqs_to_recv == []  # once


@pytest.mark.parametrize("how", ["empty_load", "aborted_while_waiting_for_room", "no_room_in_time"])
def test_a_load_never_pulled_frees_ps_staging_by_done(pair, how):  # noqa: F811
    make, _ = pair
    (pw, _), (dw, _) = make("kv_producer"), make("kv_consumer")
    publish(pw, "full")
    assert pw.source.stats()["requests_live"] == 1
    spec = recv_spec(pw, "full")
    if how == "empty_load":
        spec.num_tokens, spec.block_ids = 0, []
        dw.start_load(LynxConnectorMetadata(reqs_to_recv=[spec]))
        assert dw.take_results() == (set(), set())  # nothing for vLLM: it loads nothing asynchronously
    else:
        dw.sink.pool.alloc_request("filler", dw.sink.pool.nbytes - 4096, 0)  # D's pool has no room
        dw.start_load(LynxConnectorMetadata(reqs_to_recv=[spec]))
        assert len(dw._recv_waiting) == 1
        if how == "aborted_while_waiting_for_room":
            dw.start_load(LynxConnectorMetadata(recv_aborted=["d1"]))
            assert dw.take_results() == ({"d1"}, set())
        else:
            results_until([pw, dw], dw, lambda done, failed: "d1" in failed)  # D's timeout_s (2 s)
    poll_until([pw, dw], lambda: pw.source.stats()["requests_live"] == 0, timeout=5.0)
    st = pw.source.stats()
    assert st["freed_done"] == 1 and st["freed_lease"] == 0 and st["regions_live"] == 0


def test_more_children_than_the_cap_are_refused_without_quadratic_lists():
    """Each child's params list its siblings so far: past MAX_CHILDREN the book refuses at once (before: every
    child copied the whole group, n = 1024 cost P 8.8 s of request_finished time)."""
    from lynx_connector.fanout import MAX_CHILDREN, TooManyChildren

    book = SiblingBook(keep_s=10.0)
    for i in range(MAX_CHILDREN):
        book.add(f"{i}_{PARENT}", {"lynx_transfer_id": f"t{i}"}, now=0.0)
    with pytest.raises(TooManyChildren, match="more than"):
        book.add(f"{MAX_CHILDREN}_{PARENT}", {"lynx_transfer_id": "t"}, now=0.0)
