"""Where P's memory goes under load: a leak of the connector, or the allocator keeping freed memory?

A real P and D (``lynx_connector.lab.engine.EngineProcess``, the real model, KV over NIXL, the modes full, int8 and
bf16 in turn) get waves of 8 requests: first the same 8 prompt lengths again and again, then 8 lengths per wave that
no earlier request had, then the first 8 again. Sizes are MiB (2**20 bytes). After each wave the script reads, inside P's engine process: its RSS, glibc's ``mallinfo2``
(live heap ``uordblks``, kept free ``fordblks``) and the sizes of the connector's per-request structures on P; at
the end it calls ``malloc_trim(0)`` and reads them again. ``--no-connector`` runs a plain engine on the same
prompts (prefill only), the baseline of what vLLM and torch do alone.

    .venv/bin/python benchmarks/p_memory.py --out /tmp/p_memory.json            # about 6 min
    .venv/bin/python benchmarks/p_memory.py --no-connector --out /tmp/p_memory_plain.json

Growth that stays flat while lengths repeat, follows new lengths and goes back with ``malloc_trim`` is the
allocator; connector structures that grow with the request count would be a leak (benchmarks/README.md, "lynx bench
load"). glibc only (``mallinfo2``, ``malloc_trim``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import time
from typing import Any

MODES = ("full", "int8", "bf16")
PER_WAVE = 8
#: The connector's per-request state on P (attributes of the worker's TransferSource, its SaveQueue, and the
#: scheduler half): each must go back to (about) zero between waves.
SOURCE_STATE = ("_entries", "_by_tid", "_rejected", "_abandoned", "_orphans", "_sessions")
SAVES_STATE = ("_waiting", "_resolved", "_finished")
SCHEDULER_STATE = ("_save_tracked", "_save_mode", "_saved", "_save_ticket", "_given_ticket", "_refused",
                   "_auto_reason", "_auto_report", "_local_hits", "_verified", "_arrived")


def _mallinfo() -> dict[str, float]:
    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    m = libc.mallinfo2()
    return {"live_mb": m.uordblks / 2**20, "kept_free_mb": m.fordblks / 2**20, "mmap_mb": m.hblkhd / 2**20}


def snapshot(llm: Any) -> dict[str, Any]:
    """Probe, run in the engine process: RSS, malloc statistics, the connector's per-request state sizes."""
    import psutil

    out: dict[str, Any] = {"rss_mb": psutil.Process(os.getpid()).memory_info().rss / 2**20, **_mallinfo()}
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    if sched.connector is None:
        return out
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker
    half = sched.connector.connector_scheduler
    state = {f"source.{n}": len(getattr(worker.source, n)) for n in SOURCE_STATE}
    state.update({f"saves.{n}": len(getattr(worker.saves, n)) for n in SAVES_STATE})
    state.update({f"scheduler.{n}": len(getattr(half, n)) for n in SCHEDULER_STATE if hasattr(half, n)})
    out["connector_state"] = state
    return out


def trim(llm: Any) -> dict[str, Any]:
    """Probe: ``malloc_trim(0)`` after a garbage collection, and the snapshot after it."""
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return snapshot(llm)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixed-waves", type=int, default=8, help="waves of the same 8 prompt lengths (default 8)")
    ap.add_argument("--new-waves", type=int, default=8, help="waves of 8 new prompt lengths each (default 8)")
    ap.add_argument("--no-connector", action="store_true", help="a plain engine, prefill only (the baseline)")
    ap.add_argument("--out", help="JSON file of every wave's snapshot")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the engine imports this file's probes
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import haystack_tokens
    from lynx_connector.lab.engine import EngineProcess
    from lynx_connector.lab.models import model_dir

    model = str(model_dir())
    base = haystack_tokens(AutoTokenizer.from_pretrained(model), 1200)
    rng = random.Random(0)

    def prompts(lengths: list[int]) -> list[list[int]]:
        return [base[(o := rng.randrange(0, len(base) - n)):o + n] for n in lengths]

    unseen = list(range(130, 800))  # prompt lengths no request had yet, drawn without repeats
    rng.shuffle(unseen)

    def lengths(k: int) -> list[int]:
        return [unseen.pop() for _ in range(k)]

    kv = {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_connector.connector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"mode": "full", "staging_mb": 256, "allowed_modes": "all"}}
    p = EngineProcess(model, None if args.no_connector else kv, cpu="0")
    d = None if args.no_connector else EngineProcess(model, kv, cpu="1")
    rows: list[dict[str, Any]] = []
    sent = 0
    t0 = time.monotonic()
    try:
        def wave(phase: str, ids: list[list[int]]) -> None:
            nonlocal sent
            if d is None:
                p.generate(ids, None, max_tokens=1)
            else:
                asks = [{"do_remote_decode": True, "lynx_mode": MODES[(sent + i) % len(MODES)]} for i in range(len(ids))]
                params = [o["kv_transfer_params"] for o in p.generate(ids, asks, max_tokens=1)]
                outs = d.generate(ids, params, max_tokens=4)
                failed = [o["finish_reason"] for o in outs if o["finish_reason"] not in ("length", "stop")]
                if failed:
                    raise RuntimeError(f"requests failed: {failed}")
            sent += len(ids)
            snap = p.call("p_memory:snapshot")
            rows.append({"phase": phase, "requests": sent, "t": round(time.monotonic() - t0, 1), **snap})
            state = snap.get("connector_state", {})
            print(f"{phase:8s} {sent:4d} requests: P RSS {snap['rss_mb']:7.1f} MiB, live {snap['live_mb']:6.1f}, kept "
                  f"free {snap['kept_free_mb']:6.1f}, connector state {sum(state.values()) if state else '-'}",
                  flush=True)

        warm = [150, 300, 450]
        for n in warm:
            unseen.remove(n)
        wave("warm-up", prompts(warm))
        fixed = prompts(lengths(PER_WAVE))
        for _ in range(args.fixed_waves):
            wave("same", fixed)
        for _ in range(args.new_waves):
            wave("new", prompts(lengths(PER_WAVE)))
        for _ in range(max(1, args.fixed_waves // 2)):
            wave("same", fixed)
        rows.append({"phase": "malloc_trim", "requests": sent, **p.call("p_memory:trim")})
        last = rows[-1]
        print(f"after malloc_trim: P RSS {last['rss_mb']:.1f} MiB, live {last['live_mb']:.1f}, kept free "
              f"{last['kept_free_mb']:.1f}")
    finally:
        if d is not None:
            d.close()
        p.close()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"connector": not args.no_connector, "rows": rows}, fh, indent=1)
    first_same = next(r for r in rows if r["phase"] == "same")
    last_same = [r for r in rows if r["phase"] == "same"][args.fixed_waves - 1]
    new = [r for r in rows if r["phase"] == "new"]
    print(f"same lengths: RSS {first_same['rss_mb']:.1f} -> {last_same['rss_mb']:.1f} MiB, live heap "
          f"{first_same['live_mb']:.1f} -> {last_same['live_mb']:.1f} MiB over "
          f"{last_same['requests'] - first_same['requests']} requests")
    if new:
        print(f"new lengths: RSS {last_same['rss_mb']:.1f} -> {new[-1]['rss_mb']:.1f} MiB, live heap "
              f"{last_same['live_mb']:.1f} -> {new[-1]['live_mb']:.1f} MiB over {new[-1]['requests'] - last_same['requests']} "
              f"requests; after malloc_trim RSS {rows[-1]['rss_mb']:.1f} MiB")
    if "connector_state" in rows[-1]:
        print("connector state on P at the end (entries):",
              {k: v for k, v in rows[-1]["connector_state"].items() if v} or "all empty")
    return 0


if __name__ == "__main__":
    sys.exit(main())
