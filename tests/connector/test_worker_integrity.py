"""Integrity of a pull on the workers (fake NIXL, real codec and transport; see test_worker_fake_nixl.py): P's
staging carries a checksum trailer per layer and plane, D verifies each plane as it lands and checks the anchor's
metadata is finite before decoding, and a corrupt, non-finite or out-of-range request fails alone, releasing
staging on both sides."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from lynx_connector import worker as worker_mod
from lynx_connector.codec import IntegrityError, get_codec, staging_id
from lynx_connector.metadata import LynxConnectorMetadata, SaveSpec, mint_ticket
from lynx_connector.modes import get_mode
from tests.connector.test_worker_fake_nixl import (  # noqa: F401  (pair is a fixture)
    LAYERS,
    P_BLOCKS,
    D,
    H,
    N,
    assert_staging_freed,
    expected,
    load_errors,
    paced_events,
    pair,
    poll_until,
    publish,
    recv_spec,
    results_until,
)

pytestmark = pytest.mark.timeout(60)


def test_staging_holds_a_checksum_trailer_per_layer_per_plane(pair):  # noqa: F811
    """P's regions and D's pulls are sized by the one layout function: planes + 8-byte trailers, per layer."""
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    codec = get_codec("lynx")
    a, r = codec.plane_nbytes(N, H, D, torch.float32)
    assert p._plane_nbytes("full", N).nbytes == (LAYERS * (a + 8), LAYERS * (r + 8))
    assert d._pull_layout(recv_spec(p, "full")).nbytes == (LAYERS * (a + 8), LAYERS * (r + 8))
    assert d._pull_layout(recv_spec(p, "anchor")).nbytes == (LAYERS * (a + 8), 0)  # the residual is never pulled
    publish(p, "full")
    staged = p.source.pool.get_request("p1")
    sl = p._plane_nbytes("full", N)
    sid = staging_id(p.source.ticket("p1")[0], staged.generation)  # seeded with the transfer id and generation
    for i in range(LAYERS):
        sl.anchor.verify(staged.anchor, i, sid)
        sl.residual.verify(staged.residual, i, sid)
    with pytest.raises(IntegrityError):  # the same bytes under another tenancy of the regions
        sl.anchor.verify(staged.anchor, 0, staging_id(p.source.ticket("p1")[0], staged.generation + 1))


@pytest.mark.parametrize("mode", ["speculative", "anchor", "full", "int8", "fp8"])
def test_bit_flip_in_an_anchor_fails_that_request_only_and_leaves_the_blocks(pair, mode):  # noqa: F811
    """One bit flipped in layer 1's anchor in D's staging after the READ: that request fails (the failure policy
    applies) with the layer and plane named, nothing is written into its blocks; a sound request beside it lands
    byte-exact; staging is freed on both sides."""
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer")
    errors = load_errors(d)
    publish(p, mode, req="p1")
    publish(p, mode, req="p2")
    bad = {"flip_bit": {"plane": "anchor", "layer": 1, "byte": 37, "bit": 5}}
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, mode, req="d1", remote="p1")],
                                       test_hooks={"d1": bad}))
    done, failed = results_until([p, d], d, lambda done, failed: "d1" in done)
    assert failed == {"d1"}
    assert "layer 1 (layer.1) anchor plane fails its checksum" in errors["d1"], errors["d1"]
    assert all(not d_caches[n].any() for n in d_caches)  # untouched: verified before any decode
    spec2 = recv_spec(p, mode, req="d2", remote="p2")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[spec2]))
    done, failed = results_until([p, d], d, lambda done, failed: "d2" in done and "d2" not in d._recvs)
    assert failed == set() and errors["d2"] is None
    want = expected(p_caches, mode, full=get_mode(mode).pulls_residual)
    assert all(torch.equal(d_caches[n], want[n]) for n in d_caches)
    assert_staging_freed(p, d)


def test_bit_flip_in_a_residual_fails_that_request(pair):  # noqa: F811
    """Full mode: a flipped residual bit fails the request before the merge (nothing written)."""
    make, _ = pair
    (p, _), (d, d_caches) = make("kv_producer"), make("kv_consumer")
    errors = load_errors(d)
    publish(p, "full")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full")], test_hooks={
        "d1": {"flip_bit": {"plane": "residual", "layer": 0, "byte": 1000, "bit": 0}}}))
    done, failed = results_until([p, d], d, lambda done, failed: "d1" in done)
    assert failed == {"d1"}
    assert "layer 0 (layer.0) residual plane fails its checksum" in errors["d1"], errors["d1"]
    assert all(not d_caches[n].any() for n in d_caches)
    assert_staging_freed(p, d)


def test_bit_flip_in_a_speculative_residual_fails_the_merge_not_the_anchor(pair):  # noqa: F811
    """Speculative: the anchor (sound) is decoded and reported; the residual failing its checksum is never
    merged and is reported as residual_failed (the speculative scheduler applies the policy)."""
    make, _ = pair
    (p, p_caches), (d, d_caches) = make("kv_producer"), make("kv_consumer", residual_grace_s=0)  # see above
    paced_events(d, 1)
    errors = load_errors(d)
    publish(p, "speculative")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "speculative")], test_hooks={
        "d1": {"flip_bit": {"plane": "residual", "layer": 1, "byte": 3, "bit": 7}}}))
    poll_until([p, d], lambda: d._recvs["d1"].anchor_landed)
    assert d.take_results() == ({"d1"}, set())
    poll_until([p, d], lambda: "d1" not in d._recvs)
    assert "layer 1 (layer.1) residual plane fails its checksum" in errors["d1"]
    assert d.take_worker_meta().residual_failed == {"d1"}
    anchor = expected(p_caches, "speculative", full=False)
    assert all(torch.equal(d_caches[n], anchor[n]) for n in d_caches)  # the anchor only: no corrupt merge
    assert_staging_freed(p, d)


@pytest.mark.parametrize("mode,value", [("full", float("nan")), ("anchor", float("inf")), ("int4", float("nan")),
                                        ("fp8", float("nan"))])
def test_nonfinite_metadata_is_rejected_before_decoding(pair, monkeypatch, mode, value):  # noqa: F811
    """A scale that is not finite (here written by P before it seals the layer, so the checksum holds) fails the
    request on D before any decode: never NaN in D's cache."""
    make, _ = pair
    (p, _), (d, d_caches) = make("kv_producer"), make("kv_consumer")
    errors = load_errors(d)
    real_encode = worker_mod.encode
    codec = get_codec(get_mode(mode).codec)

    def encode_bad_scale(codec_, kv, block_ids, layout, num_tokens, anchor_out, residual_out=None, **kw):
        real_encode(codec_, kv, block_ids, layout, num_tokens, anchor_out, residual_out, **kw)
        if kw.get("layer_name") == "layer.1":
            codes = N * H * D if mode == "fp8" else N * H * D * codec.bits // 8  # K's codes, then K's scales
            anchor_out[codes + 2:codes + 4].view(torch.float16)[0] = value

    monkeypatch.setattr(worker_mod, "encode", encode_bad_scale)
    publish(p, mode)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, mode)]))
    done, failed = results_until([p, d], d, lambda done, failed: "d1" in done)
    assert failed == {"d1"}
    assert "layer 1 (layer.1).k: anchor plane scale metadata is not finite" in errors["d1"], errors["d1"]
    assert all(not d_caches[n].any() for n in d_caches)
    assert_staging_freed(p, d)


def test_a_peer_without_the_same_integrity_format_fails_the_handshake(pair, caplog):  # noqa: F811
    """P and D must stage the same trailers: the format is one of the compat fields, so a mismatch fails the
    handshake; D hears only that P refused it (protocol v2 reveals nothing), P's log names the field."""
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    assert p.source.compat["integrity"] == d.sink.compat["integrity"] == "xxh3_64/trailer8/v2"
    p.source.compat["integrity"] = "none"
    errors = load_errors(d)
    publish(p, "full")
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[recv_spec(p, "full")]))
    done, failed = results_until([p, d], d, lambda done, failed: "d1" in done)
    assert failed == {"d1"} and "refused" in errors["d1"] and "incompatible" in errors["d1"], errors["d1"]
    assert any("incompatible peer" in r.getMessage() and "integrity: ours='none'" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert d.sink.pool.regions_live == 0 and d._recvs == {}


@pytest.mark.parametrize("mode", ["full", "int8", "int4"])
def test_p_kv_beyond_the_codecs_range_fails_that_request_only(pair, monkeypatch, mode):  # noqa: F811
    """|x| > 65504 in P's KV (the test hook kv_range writes 7e4 into P's cache of that request): the real codec
    raises KVRangeError in P's encode; P rejects only that request ('range_kv'), D fails it at once (no wait for
    timeout_s) by the failure policy, a request encoded beside it lands, both sides end idle."""
    monkeypatch.setenv("LYNX_TEST_HOOKS", "1")
    make, _ = pair
    (p, _), (d, _) = make("kv_producer"), make("kv_consumer")
    errors = load_errors(d)
    p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id="p2", block_ids=P_BLOCKS, num_tokens=N, mode=mode)]))
    # the hook writes into P's cache, which p2 shares here: p2 was encoded just before
    tid, tok = mint_ticket()  # minted by P's scheduler half, as in production (D presents them)
    p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id="p1", block_ids=P_BLOCKS, num_tokens=N, mode=mode,
                                                        transfer_id=tid, token=tok)],
                                 test_hooks={"p1": {"kv_range": True}}))
    assert p.stats.data["failed_range"] == 1 and p.source.stats()["rejected"] == 1
    t0 = time.monotonic()
    d1 = dataclasses.replace(recv_spec(p, mode, "d1", "p1"), transfer_id=tid, token=tok)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[d1, recv_spec(p, mode, "d2", "p2")]))
    done, failed = results_until([p, d], d, lambda done, failed: {"d1", "d2"} <= done)
    assert failed == {"d1"} and time.monotonic() - t0 < 5.0
    assert "range_kv" in errors["d1"] and "65504" in errors["d1"], errors["d1"]
    assert errors["d2"] is None
    assert_staging_freed(p, d)
