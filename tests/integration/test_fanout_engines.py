"""Issue 18.1 on real engines: requests vLLM splits into children (``n > 1``) through `lynx proxy` behave as on
one vLLM server. n=2 and n=4, greedy and seeded sampling, streaming and not, /v1/completions and
/v1/chat/completions: every request answered, every child's KV pulled from P (P freed each child's staging on
its Done, none by lease, no unknown transfer), greedy children equal the n=1 answer and sampled child i equals
the n=1 answer with seed + i (vLLM's per-child seed), and P and D back to idle (queues, staging, KV blocks)
well before P's lease. Children a client abandons while they wait in D's queue free P's staging at once.
Latencies relative to n=1 are measured and written to the log folder (``fanout_latency.json``), not asserted.
Real `lynx serve` P and D, the real model, real NIXL; one deployment for every case."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(1200)]

LEASE_S = 300.0  # idle must come from the children's Dones, long before a lease could free anything
IDLE_WITHIN_S = 45.0
MAX_TOKENS = 12
SEED = 1234
PROMPT = ("Paul Graham wrote that the best way to get startup ideas is not to try to think of startup ideas. "
          "Instead, look for problems, preferably problems you have yourself. Summarize this advice:")
LATENCY: dict[str, Any] = {}


@pytest.fixture(scope="module")
def dep(tmp_path_factory, model):
    from lynx_connector.lab.launch import Deployment
    logs = tmp_path_factory.mktemp("fanout")
    status = logs / "status"
    cfg = json.dumps({"kv_connector": "lynx", "kv_load_failure_policy": "fail",
                      "kv_connector_extra_config": {"lease_s": LEASE_S, "status_dir": str(status)}})
    with Deployment(model, logs, kv_transfer_config=cfg, max_model_len=2048) as d:
        d.status_dir, d.model, d.kv_config = status, model, cfg
        yield d
    (logs / "fanout_latency.json").write_text(json.dumps(LATENCY, indent=1))
    print("fan-out latency (s), n=1 next to n=k:", json.dumps(LATENCY))


def source_counters(status_dir: Path) -> dict[str, int]:
    """P's transport counters (sum over its workers' status files)."""
    out: dict[str, int] = {}
    for path in status_dir.glob("*.json"):
        src = json.loads(path.read_text()).get("source")
        for k in ("freed_done", "freed_lease", "freed_abort", "unknown_request", "served_queries"):
            out[k] = out.get(k, 0) + int(src.get(k, 0)) if src else out.get(k, 0)
    return out


def fresh(status_dir: Path, since: float) -> bool:
    """Every worker's status file written after ``since`` (wall clock): they are written about once a second,
    so an older one may show a state from before the request."""
    times = []
    for path in status_dir.glob("*.json"):
        try:
            times.append(json.loads(path.read_text())["time"])
        except (OSError, ValueError, KeyError):
            return False
    return bool(times) and min(times) > since


def assert_idle(dep) -> dict:
    from lynx_connector.lab.bench.load import IDLE_KEYS, Sampler

    sampler = Sampler(dep, dep.status_dir, time.monotonic())
    end = time.monotonic() + IDLE_WITHIN_S
    since = time.time()
    while True:
        while not fresh(dep.status_dir, since):
            assert time.monotonic() < end, "the workers' status files are not written any more"
            time.sleep(0.2)
        since = time.time()
        snap = sampler.snapshot()
        busy = {k: snap.get(k) for k in (*IDLE_KEYS, "p_kv_usage", "d_kv_usage") if snap.get(k)}
        if not busy:
            return snap
        assert time.monotonic() < end, f"not idle {IDLE_WITHIN_S}s after the request (lease {LEASE_S}s): {busy}"
        time.sleep(0.5)


def body(endpoint: str, model: str, n: int, seed: int | None, stream: bool) -> dict[str, Any]:
    # vLLM refuses n > 1 with temperature 0 ("n must be 1 when using greedy sampling"): greedy here is top_k=1
    b: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "n": n, "ignore_eos": True, "stream": stream,
                         "temperature": 0.8, "kv_transfer_params": {"lynx_mode": "full"}}
    if seed is None:
        b["top_k"] = 1
    else:
        b["seed"] = seed
    if endpoint == "chat":
        b["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        b["prompt"] = PROMPT
    return b


def ask(dep, endpoint: str, n: int, seed: int | None, stream: bool) -> tuple[dict[int, str], dict[int, str], float]:
    """One request through the proxy: (text by choice index, finish reason by index, seconds)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    req = urllib.request.Request(dep.url + path, data=json.dumps(body(endpoint, dep.model, n, seed, stream)).encode(),
                                 headers={"Content-Type": "application/json"})
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as resp:
        if stream:
            chunks = []
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunks.append(json.loads(line[5:]))
        else:
            chunks = [json.loads(resp.read())]
    seconds = time.monotonic() - t0
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for ch in chunk["choices"]:
            part = (ch.get("delta") or {}).get("content") if stream and endpoint == "chat" else None
            part = part if part is not None else (ch.get("message") or {}).get("content") or ch.get("text") or ""
            texts[ch["index"]] = texts.get(ch["index"], "") + part
            if ch.get("finish_reason"):
                reasons[ch["index"]] = ch["finish_reason"]
    return texts, reasons, seconds


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_children_get_their_own_kv_and_answer_like_one_vllm_server(dep, endpoint, stream):
    singles = {}  # n=1 answers: greedy, and sampled with each child's seed (vLLM gives child i seed + i)
    for seed in (None, *(SEED + i for i in range(4))):
        texts, _, seconds = ask(dep, endpoint, 1, seed, stream)
        singles[seed] = (texts[0], seconds)
    assert_idle(dep)
    for n in (2, 4):
        for seed in (None, SEED):
            case = f"{endpoint}/{'stream' if stream else 'plain'}/n={n}/{'greedy' if seed is None else 'sampled'}"
            before = source_counters(dep.status_dir)
            texts, reasons, seconds = ask(dep, endpoint, n, seed, stream)
            assert sorted(texts) == list(range(n)), (case, texts)
            assert all(reasons.get(i) == "length" for i in range(n)), (case, reasons)
            for i in range(n):
                want = singles[None if seed is None else seed + i][0]
                assert texts[i] == want, (case, i, texts[i], want)
            assert_idle(dep)
            after = source_counters(dep.status_dir)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            # every child pulled its own staging from P, freed by its Done: no lease, no unknown transfer
            assert delta["freed_done"] == n and delta["freed_lease"] == 0 and delta["unknown_request"] == 0, \
                (case, delta)
            base = singles[None if seed is None else seed][1]
            LATENCY[case] = {"n1_s": round(base, 3), "s": round(seconds, 3), "ratio": round(seconds / base, 2)}
    assert "computing its prompt locally" not in dep.decode.log_path.read_text()


def open_stream(url: str, b: dict[str, Any]) -> socket.socket:
    """A streamed completion sent over a raw socket (so the test can drop it)."""
    from urllib.parse import urlsplit

    payload = json.dumps(b).encode()
    u = urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=120)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def first_chunk(sock: socket.socket) -> None:
    got = b""
    while b"data:" not in got:
        data = sock.recv(4096)
        assert data, f"connection closed before the first chunk: {got[:300]!r}"
        got += data


def wait_gauge(url: str, key: str, pred, what: str, timeout: float = 60.0) -> None:
    from lynx_connector.lab.bench.load import scrape_gauges

    end = time.monotonic() + timeout
    while not pred(scrape_gauges(url).get(key, 0)):
        assert time.monotonic() < end, what
        time.sleep(0.2)


def test_children_aborted_in_ds_queue_free_ps_staging_at_once(dep):
    """D restarted with room for 2 running requests, both taken by a long n=2 stream through the proxy. An n=4
    request prefilled on P (its 4 children staged) is sent to D (as a router does), waits in D's queue (vLLM
    matches no KV while all run slots are taken: no pull starts) and its client disconnects: D aborts the 4
    children unscheduled and its scheduler half has P's 4 stagings freed by Dones at once, not at the lease,
    while the occupant still runs. Then the occupant's client goes too; everything is idle."""
    from lynx_connector.proxy import build_prefill_request

    t_restart = time.time()
    dep.restart_decode(dep.kv_config, log_path=dep.log_dir / "decode-2seqs.log", extra_args=["--max-num-seqs", "2"])
    for path in dep.status_dir.glob("*.json"):  # the old D's files (P's are written every second, idle or not)
        if json.loads(path.read_text())["time"] < t_restart:
            path.unlink()
    assert_idle(dep)
    before = source_counters(dep.status_dir)
    long = body("completions", dep.model, 2, SEED, True) | {"max_tokens": 1500}
    with open_stream(dep.url, long) as occupant:
        first_chunk(occupant)  # both of D's run slots taken
        queued = body("completions", dep.model, 4, SEED, True) | {"max_tokens": 1500}
        req = urllib.request.Request(dep.prefill.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps(build_prefill_request(queued, chat=False)).encode())
        with urllib.request.urlopen(req, timeout=120) as resp:
            params = json.loads(resp.read())["kv_transfer_params"]
        with open_stream(dep.decode.url, queued | {"kv_transfer_params": params}):
            wait_gauge(dep.decode.url, "waiting", lambda v: v >= 4, "the 4 children never queued on D")
        wait_gauge(dep.decode.url, "waiting", lambda v: v == 0, "D did not abort the queued children")
        end = time.monotonic() + IDLE_WITHIN_S
        while source_counters(dep.status_dir)["freed_done"] - before["freed_done"] < 4:  # with the occupant on
            assert time.monotonic() < end, f"P's stagings not freed: {source_counters(dep.status_dir)}"
            time.sleep(0.5)
    assert_idle(dep)
    delta = {k: v - before.get(k, 0) for k, v in source_counters(dep.status_dir).items()}
    assert delta["freed_lease"] == 0 and delta["freed_done"] == 6, delta
