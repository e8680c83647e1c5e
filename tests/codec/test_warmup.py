"""codec/warmup.py: the start-up warm-up runs every JIT kernel path a real request then uses (so no request pays a
compile inside P's forward or D's pull), on scratch blocks, never touching the cache it is shaped after."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from lynx_connector.codec import CODEC_NAMES, KVLayout, get_codec
from lynx_connector.codec.warmup import warm_up


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_warm_up_runs_every_codec_and_leaves_the_cache_alone(name) -> None:
    like = torch.full((8, 2, 16, 64), 3.0, dtype=torch.bfloat16)
    layout = KVLayout.from_kv_cache(like, block_size=16)
    seconds = warm_up(get_codec(name), layout, like)
    assert seconds > 0
    assert torch.equal(like, torch.full_like(like, 3.0))


def test_after_warm_up_a_real_request_compiles_nothing_new() -> None:
    """In a fresh process (no kernel compiled or loaded yet): after `warm_up`, encoding and decoding a 1000-token
    request through shuffled blocks adds no compiled signature to any numba kernel, and the warm-up compiled
    some (it does reach the JIT paths)."""
    pytest.importorskip("numba")
    script = textwrap.dedent("""
        import json, torch
        from numba.core.registry import CPUDispatcher
        from lynx_connector.codec import KVLayout, get_codec, encode, decode_anchor, merge_residual, staged_layout
        from lynx_connector.codec.numba_path import numba_kernels
        from lynx_connector.codec.warmup import warm_up
        from lynx_connector.kernels import groupquant_numba, groupquant_numba_f32, groupquant_numba_kv

        def sigs():
            return sum(len(v.signatures) for m in (groupquant_numba, groupquant_numba_f32, groupquant_numba_kv)
                       for v in vars(m).values() if isinstance(v, CPUDispatcher))

        out = {"numba": numba_kernels() is not None, "runs": []}
        for dt in (torch.bfloat16, torch.float32):
            like = torch.zeros((64, 3, 16, 128), dtype=dt)
            lay = KVLayout.from_kv_cache(like, block_size=16)
            codec = get_codec("lynx")
            before = sigs()
            warm_up(codec, lay, like)
            warmed = sigs()
            kv = torch.randn(like.shape).to(dt)
            n, ids = 1000, list(range(63, -1, -1))
            sl = staged_layout(codec, lay, n, 1)
            a = sl.anchor.plane(torch.zeros(sl.anchor.nbytes, dtype=torch.uint8), 0)
            r = sl.residual.plane(torch.zeros(sl.residual.nbytes, dtype=torch.uint8), 0)
            encode(codec, kv, ids, lay, n, a, r)
            dst = torch.zeros_like(kv)
            decode_anchor(codec, a, dst, ids, lay, n)
            merge_residual(codec, a, r, dst, ids, lay, n)
            out["runs"].append([str(dt), before, warmed, sigs()])
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["numba"]:
        pytest.skip("numba kernels disabled here")
    first = out["runs"][0]
    assert first[2] > first[1], out  # the warm-up compiled (or loaded) kernels
    for dt, _, warmed, after in out["runs"]:
        assert after == warmed, f"{dt}: the request compiled {after - warmed} new kernel signatures: {out}"
