"""Heterogeneous P and D through the worker halves (issue 18.4): real codec on real CPU-layout caches, real
transport (zmq side channel), fake NIXL. P and D differ in block size (16, 32, 128) and cache dtype (fp32,
bf16); for every mode of the modes table D ends up holding what a D configured like P holds, in its own dtype;
the compat check passes them and still names what must match (tensor-parallel size, head size)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lynx_connector import worker as worker_mod
from lynx_connector.codec import KVLayout, decode_anchor, encode, get_codec, merge_residual, staged_layout
from lynx_connector.config import LynxConfig
from lynx_connector.metadata import LynxConnectorMetadata, RecvSpec, SaveSpec
from lynx_connector.modes import MODE_NAMES, get_mode
from tests.connector.test_worker_fake_nixl import load_errors, poll_until, results_until, use_fake_nixl

pytestmark = pytest.mark.timeout(120)

H, HD, LAYERS, N = 2, 32, 2, 300  # 300 tokens: K groups of 256, V groups of 32, a partial last block
F32, BF16 = torch.float32, torch.bfloat16


def blocks(bs: int) -> int:
    return -(-N // bs)


@pytest.fixture
def make(monkeypatch):
    use_fake_nixl(monkeypatch)
    made = []

    def build(role: str, bs: int, dtype: torch.dtype):
        vcfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role=role),
                               cache_config=SimpleNamespace(block_size=bs), model_config=SimpleNamespace(model="tiny"))
        w = worker_mod.LynxConnectorWorker(vcfg, "e-" + role, LynxConfig.from_extra_config(
            {"staging_mb": 8, "timeout_s": 3}))
        nb = blocks(bs) + 3
        gen = torch.Generator().manual_seed(7)
        if role == "kv_producer":  # same token values whatever the layout: scattered through the layout
            caches = {f"layer.{i}": torch.randn(nb, H, bs, 2 * HD, generator=gen).to(dtype) for i in range(LAYERS)}
            layout = KVLayout.from_kv_cache(caches["layer.0"], block_size=bs)
            for i, c in enumerate(caches.values()):
                g = torch.Generator().manual_seed(100 + i)
                k = torch.randn(N, H, HD, generator=g) * 2 + 3 * (torch.arange(HD) == 5)
                layout.scatter(c, p_ids(bs), N, k, torch.randn(N, H, HD, generator=g))
        else:
            caches = {f"layer.{i}": torch.zeros(nb, H, bs, 2 * HD, dtype=dtype) for i in range(LAYERS)}
        w.register_kv_caches(caches)
        made.append(w)
        return w, caches

    yield build
    for w in made:
        w.shutdown()


def p_ids(bs: int) -> list[int]:
    return list(range(blocks(bs)))[::-1]  # P's blocks in reverse order


def d_ids(bs: int) -> list[int]:
    return [i + 2 for i in range(blocks(bs))]


def transfer(p, d, mode: str, p_bs: int, d_bs: int, kv_dtype: str | None = None,
             p_frees: bool = True) -> tuple[set[str], set[str]]:
    p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id="p1", block_ids=p_ids(p_bs), num_tokens=N,
                                                        mode=mode)]))
    host, port = p.source.address
    tid, token = p.source.ticket("p1")
    announced = p.handshake_metadata().kv_dtype  # what P's scheduler half puts into kv_transfer_params
    spec = RecvSpec(req_id="d1", block_ids=d_ids(d_bs), num_tokens=N, skip_blocks=0, remote_host=host,
                    remote_ports=(port,), remote_req_id="p1", remote_engine_id="e-p", mode=mode, transfer_id=tid,
                    token=token, kv_dtype=announced if kv_dtype is None else kv_dtype)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[spec], test_hooks={}))
    out = results_until([p, d], d, lambda done, failed: "d1" in done and "d1" not in d._recvs)
    if p_frees:  # D told P it is done (a refused handshake leaves it to P's lease)
        poll_until([p, d], lambda: p.source.stats()["regions_live"] == 0)
    assert d.sink.pool.regions_live == 0
    return out


def same_config(p_caches, p_bs: int, mode: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Token-major K, V a D configured like P (block size, dtype) holds after the mode's transfer."""
    codec = get_codec(get_mode(mode).codec)
    full = get_mode(mode).pulls_residual
    out = {}
    for name, kv in p_caches.items():
        layout = KVLayout.from_kv_cache(kv, block_size=p_bs)
        sl = staged_layout(codec, layout, N, 1)
        anchor = torch.zeros(sl.anchor.plane_nbytes, dtype=torch.uint8)
        residual = torch.zeros(sl.residual.plane_nbytes, dtype=torch.uint8) if sl.residual.plane_nbytes else None
        encode(codec, kv, p_ids(p_bs), layout, N, anchor, residual)
        ref = torch.zeros_like(kv)
        ids = d_ids(p_bs)
        if full:
            merge_residual(codec, anchor, residual, ref, ids, layout, N)
        else:
            decode_anchor(codec, anchor, ref, ids, layout, N)
        out[name] = layout.gather(ref, ids, N)
    return out


CONFIGS = [((32, F32), (128, F32)), ((128, F32), (16, F32)), ((16, F32), (32, BF16)), ((32, BF16), (128, F32)),
           ((128, BF16), (16, BF16))]


@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize(("p_cfg", "d_cfg"), CONFIGS, ids=lambda c: f"bs{c[0]}-{str(c[1])[6:]}")
def test_d_of_another_block_size_and_dtype_holds_the_same_config_result(make, mode, p_cfg, d_cfg):
    (p_bs, p_dtype), (d_bs, d_dtype) = p_cfg, d_cfg
    (p, p_caches), (d, d_caches) = make("kv_producer", p_bs, p_dtype), make("kv_consumer", d_bs, d_dtype)
    assert p.layout.block_size == p_bs and d.layout.block_size == d_bs
    errors = load_errors(d)
    done, failed = transfer(p, d, mode, p_bs, d_bs)
    assert failed == set(), errors
    same = same_config(p_caches, p_bs, mode)
    lossless = get_mode(mode).lossless
    for name, kv in d_caches.items():
        d_layout = KVLayout.from_kv_cache(kv, block_size=d_bs)
        got = d_layout.gather(kv, d_ids(d_bs), N)
        for g, s, tag in zip(got, same[name], "kv", strict=True):
            if d_dtype.itemsize >= p_dtype.itemsize:
                # exact: D's dtype holds every value of P's (a wider D keeps more of a quantized decode, which
                # rounds back to the same-config result)
                assert torch.equal(g.to(p_dtype), s), (name, tag)
                if lossless or p_dtype == d_dtype:
                    assert torch.equal(g, s.to(d_dtype)), (name, tag)
            else:  # fp32 P -> bf16 D: rounded once on write
                assert torch.equal(g, s.to(d_dtype)), (name, tag)
        untouched = torch.ones(kv.shape[0], dtype=torch.bool)
        untouched[d_ids(d_bs)] = False
        assert not kv[untouched].any()


def test_lossless_mode_is_bit_exact_into_a_wider_d(make):
    """bf16 P -> fp32 D in the lossless mode: D holds P's bf16 values exactly (the wire carries P's dtype)."""
    (p, p_caches), (d, d_caches) = make("kv_producer", 32, BF16), make("kv_consumer", 128, F32)
    assert transfer(p, d, "bf16", 32, 128)[1] == set()
    for name, kv in d_caches.items():
        p_k, p_v = KVLayout.from_kv_cache(p_caches[name], block_size=32).gather(p_caches[name], p_ids(32), N)
        d_k, d_v = KVLayout.from_kv_cache(kv, block_size=128).gather(kv, d_ids(128), N)
        assert torch.equal(d_k, p_k.float()) and torch.equal(d_v, p_v.float())


def test_unannounced_dtype_fails_that_request_clearly(make):
    """A P that did not announce its dtype (D assumes its own): the passthrough's sizes differ and the pull
    fails with the sizes named, staging freed; the quantizing modes do not depend on it."""
    (p, _), (d, d_caches) = make("kv_producer", 32, F32), make("kv_consumer", 128, BF16)
    errors = load_errors(d)
    done, failed = transfer(p, d, "bf16", 32, 128, kv_dtype="")
    assert failed == {"d1"} and "size" in errors["d1"], errors
    assert all(not kv.any() for kv in d_caches.values())


def test_compat_names_what_must_match_and_nothing_else(make, caplog):
    (p, _), (d, _) = make("kv_producer", 32, F32), make("kv_consumer", 128, BF16)
    assert p.source.compat == d.sink.compat  # block size, layout and dtype are not compat fields
    assert set(p.source.compat) == {"model", "layers", "layer_names", "kv_heads", "head_size", "lynx_codec",
                                    "integrity", "tp_rank", "tp_size", "model_revision", "rope"}
    p.source.compat["tp_size"] = 2  # a P of another tensor-parallel size
    errors = load_errors(d)
    done, failed = transfer(p, d, "full", 32, 128, p_frees=False)
    assert failed == {"d1"} and "incompatible" in errors["d1"], errors
    assert any("incompatible peer" in r.getMessage() and "tp_size: ours=2 theirs=1" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_compat_compares_the_codec_in_use_not_its_spelling():
    """``group_tokens`` replaces both per-tensor defaults: P with {"group_tokens": 128} and D with 128 plus
    explicit K 64 / V 32 run different codecs (their merged options looked alike and the handshake accepted
    them); the same codec spelled two ways is one codec. The default's compat string is unchanged."""
    import json

    from lynx_connector.codec import LYNX_DEFAULTS
    from lynx_connector.compat import kv_compat

    layout = KVLayout.from_kv_cache(torch.zeros(4, 2, 16, 128), block_size=16)

    def codec_of(**options):
        return kv_compat(model="m", layer_names=["l0"], layout=layout, codec_options=options, tp_rank=0,
                         tp_size=1)["lynx_codec"]

    assert codec_of() == json.dumps(LYNX_DEFAULTS, sort_keys=True)
    assert codec_of(group_tokens=128) != codec_of(group_tokens=128, k_group_tokens=64, v_group_tokens=32)
    assert codec_of() == codec_of(group_tokens=7, k_group_tokens=64, v_group_tokens=32)


def test_a_p_of_another_tensor_parallel_size_fails_the_pull_at_once_naming_it(make):
    """D knows P's tensor-parallel size (the ports P advertises) and its own: another one is refused before any
    connection. D dialled P's rank 0 and failed after four refused handshakes naming the key or layout."""
    (p, _), (d, _) = make("kv_producer", 32, F32), make("kv_consumer", 32, F32)
    p.save(LynxConnectorMetadata(reqs_to_save=[SaveSpec(req_id="p1", block_ids=p_ids(32), num_tokens=N,
                                                        mode="full")]))
    host, port = p.source.address
    tid, token = p.source.ticket("p1")
    errors = load_errors(d)
    spec = RecvSpec(req_id="d1", block_ids=d_ids(32), num_tokens=N, skip_blocks=0, remote_host=host,
                    remote_ports=(port, port + 1), remote_req_id="p1", remote_engine_id="e-p", mode="full",
                    transfer_id=tid, token=token)
    d.start_load(LynxConnectorMetadata(reqs_to_recv=[spec], test_hooks={}))
    done, failed = results_until([p, d], d, lambda done, failed: "d1" in failed)
    assert "P runs tensor-parallel size 2, this decode instance 1" in errors["d1"], errors
    assert p.source.stats()["auth_failed"] == 0 and d.sink.pool.bytes_allocated == 0


def test_an_fp8_kv_cache_is_refused_at_start(make):
    """vLLM's CPU backend keeps an fp8 cache (--kv-cache-dtype fp8) as uint8: the codecs wrote decoded floats into
    it as integers (the pull reported success) or failed each request with a bare TypeError."""
    with pytest.raises(ValueError, match=r"KV cache of torch.uint8 .* not supported.*--kv-cache-dtype auto"):
        make("kv_consumer", 16, torch.uint8)
