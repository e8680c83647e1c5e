"""Issue 15 on real engines: the pipelined flow (``lynx proxy --flow pipelined``: P and D get the request at once,
P publishes each layer as it is encoded inside the forward, D pulls it at once) gives the same greedy text as the
sequential flow for every mode; a client that leaves before P finished, a request P refuses, and a P killed
mid-prefill each end for that request only, and afterwards nothing is staged, pulled or queued on either side;
a greedy speculative request releases P's first token on the anchor (it reaches D through P's side channel).
Real `lynx serve` P and D, two `lynx proxy` (one per flow), the real model, real NIXL."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from lynx_connector.auto import AUTO_REASONS
from tests.integration.test_load_recovery import Pair, assert_idle, complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a hang costs CI 10 min, not 25

TIMEOUT_S = 8.0  # D gives up on a P that publishes nothing more for this long
WAIT_S = 20.0  # concurrent_wait_s: how long D waits for P to start publishing
MODES = ("full", "speculative", "int8", "bf16", "int4")
#: The first-token test's D link (its transport's token bucket, Gbit/s): slower than P's prefill produces KV on this
#: machine (~16 KB per token at a few hundred tokens/s), so a speculative request's residual lands seconds after P
#: has finished: the transfer-dominated regime where decoding on the anchor, and P's first token, matter.
SLOW_LINK_GBPS = 0.01


def kv_config(side_port: int, status: str, **extra) -> str:
    return json.dumps({"kv_connector": "lynx:speculative", "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"timeout_s": TIMEOUT_S, "concurrent_wait_s": WAIT_S,
                                                     "side_channel_port": side_port, "status_dir": status,
                                                     "allowed_modes": "all", **extra}})


@pytest.fixture(scope="module")
def dep(tmp_path_factory, model):
    from lynx_connector.lab.launch import Deployment, free_port
    logs = tmp_path_factory.mktemp("pipelined")
    status = logs / "status"
    with_port = kv_config(free_port(), str(status))  # P's side channel on a fixed port (the restart test)
    d = Deployment(model, logs, kv_transfer_config=with_port, max_model_len=4096,
                   decode_serve_args=["--kv-transfer-config", kv_config(0, str(status))],
                   proxy_args=["--flow", "pipelined"])
    d.prefill.argv += ["--shutdown-timeout", "60"]  # SIGTERM drains (the last test stops P that way)
    seq = d.add_proxy("proxy-sequential", ["--flow", "sequential"])
    other_key = d.add_proxy("proxy-other-key", ["--flow", "pipelined"])  # misconfigured: not the deployment's key
    other_key.env["LYNX_SIDE_CHANNEL_KEY"] = secrets.token_hex(32)
    with d:
        pair = Pair(d, status, model)
        pair.seq_url = seq.url  # type: ignore[attr-defined]
        pair.other_key_url = other_key.url  # type: ignore[attr-defined]
        yield pair


def _prompt(n_sentences: int, seed: int = 0) -> str:
    body = " ".join(f"Fact {seed}.{i}: the river passes mill number {i * 7 + seed} before the bridge."
                    for i in range(n_sentences))
    return f"Read the notes and summarize them.\n\n{body}\n\nSummary:"


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/lynx/stats", timeout=10) as resp:
        return json.load(resp)


def _endpoint_counters(status_dir, keys=("partial_published", "pipelined_pulls", "early_pulls", "first_tokens")
                       ) -> dict[str, float]:
    from lynx_connector.transport.status import writer_alive

    out = dict.fromkeys(keys, 0.0)
    for path in status_dir.glob("*.json"):
        data = json.loads(path.read_text())
        if not writer_alive(data):
            continue
        for side in ("source", "sink"):
            for key in out:
                out[key] += (data.get(side) or {}).get(key, 0)
    return out


@pytest.fixture
def slow_link(tmp_path_factory, model):
    from lynx_connector.lab.launch import Deployment
    logs = tmp_path_factory.mktemp("pipelined-slow-link")
    status = logs / "status"
    d = Deployment(model, logs, kv_transfer_config=kv_config(0, str(status)), max_model_len=4096,
                   decode_serve_args=["--kv-transfer-config",
                                      kv_config(0, str(status), link_gbps=SLOW_LINK_GBPS)],
                   proxy_args=["--flow", "pipelined"])
    with d:
        yield Pair(d, status, model)


def test_pipelined_speculative_releases_p_first_token_on_the_anchor(slow_link):
    """Issue 15's first token: D's params in the concurrent flow carry no ``lynx_first_token`` (P has sampled
    nothing yet); P names it on the side channel a step after the prompt, D's pull asks until it has it, and a
    greedy speculative request releases its first token on the anchor, as in the sequential flow. The output
    equals full mode's. Its own P and D (D on a slow link: the residual lands seconds after P has finished, so D
    decodes on the anchor meanwhile), first in this file so that only one pair runs at a time."""
    from lynx_connector.lab.bench.e2e.measure import counter_delta, scrape_counters

    dep = slow_link
    warm = complete(dep.url, dep.model, _prompt(4, seed=11), "full", max_tokens=2)  # the proxy learns P
    assert warm["ok"], warm
    prompt = _prompt(30, seed=12)
    ref = complete(dep.url, dep.model, prompt, "full", max_tokens=24)
    before = scrape_counters(dep.dep.decode.url)
    spec = complete(dep.url, dep.model, prompt, "speculative", max_tokens=24,
                    params={"lynx_mode": "speculative", "lynx_report": True})
    assert ref["ok"] and spec["ok"], (ref.get("error"), spec.get("error"))
    assert spec["out"]["choices"][0]["text"] == ref["out"]["choices"][0]["text"]
    summary = spec["out"]["kv_transfer_params"]["lynx_speculation"]
    delta = counter_delta(before, scrape_counters(dep.dep.decode.url))
    assert summary["first_token_early"] == 1 and summary["first_token_mismatch"] == 0, summary
    assert delta["lynx_early"] == 1, delta  # what `lynx bench e2e` reports as first_token_on_anchor
    assert _endpoint_counters(dep.status_dir)["first_tokens"] >= 1
    # Auto (issue 16.3, protocol v3), pipelined too: P has measured this slow link from D's reads of the requests
    # above, chooses speculative as it prefills and names it on the side channel; D serves it so, the output
    # equals full's, and the final params name the choice.
    flows = _stats(dep.url)["flows"]["pipelined"]
    auto = complete(dep.url, dep.model, prompt, "auto", max_tokens=24)
    assert auto["ok"], auto.get("error")
    assert auto["out"]["choices"][0]["text"] == ref["out"]["choices"][0]["text"]
    assert auto["out"]["kv_transfer_params"]["lynx_auto"] == {"mode": "speculative", "reason": "slow_link"}
    assert _stats(dep.url)["flows"]["pipelined"] == flows + 1
    assert_idle(dep)


def test_auto_is_pipelined_and_p_names_its_choice(dep):
    """Auto behind the pipelined proxy (issue 16.3): D is told ``auto``, P chooses as it prefills (from the link it
    measured on this unpaced local link: the passthrough or, while its measure is still rough, speculative) and
    names its choice in its side-channel Regions; D sizes the pull by it and serves it as that mode (a Lynx choice
    as speculative: this D runs the speculative scheduler). Each text equals the sequential flow's for the mode
    served (speculative's is full's), D's final params name the choice, the proxy counts the requests as
    pipelined, and nothing is left behind."""
    prompt = _prompt(40, seed=5)
    warm = complete(dep.url, dep.model, _prompt(4, seed=6), "full", max_tokens=2)  # the proxy learns P
    assert warm["ok"], warm
    ref = {m: complete(dep.seq_url, dep.model, prompt, m, max_tokens=24) for m in ("bf16", "full")}
    assert all(r["ok"] for r in ref.values()), {m: r.get("error") for m, r in ref.items()}
    before = _stats(dep.url)["flows"]["pipelined"]
    outs = [complete(dep.url, dep.model, prompt, "auto", max_tokens=24) for _ in range(3)]
    assert all(o["ok"] for o in outs), [o.get("error") for o in outs]
    chosen = [o["out"]["kv_transfer_params"]["lynx_auto"] for o in outs]
    for out, choice in zip(outs, chosen, strict=True):
        assert choice["mode"] in ("bf16", "speculative") and choice["reason"] in AUTO_REASONS, choice
        same_as = "bf16" if choice["mode"] == "bf16" else "full"
        assert out["out"]["choices"][0]["text"] == ref[same_as]["out"]["choices"][0]["text"], choice
    assert _stats(dep.url)["flows"]["pipelined"] - before == len(outs)
    assert _endpoint_counters(dep.status_dir)["early_pulls"] >= len(outs)
    assert_idle(dep)


def test_pipelined_flow_equals_sequential_for_every_mode(dep):
    prompt = _prompt(60)
    warm = complete(dep.url, dep.model, prompt, "full", max_tokens=4)  # the proxy learns P's side channel
    assert warm["ok"], warm
    before = _stats(dep.url)["flows"]["pipelined"]
    for mode in MODES:
        seq = complete(dep.seq_url, dep.model, prompt, mode, max_tokens=24)
        pipe = complete(dep.url, dep.model, prompt, mode, max_tokens=24)
        assert seq["ok"] and pipe["ok"], (mode, seq.get("error"), pipe.get("error"))
        assert pipe["out"]["choices"][0]["text"] == seq["out"]["choices"][0]["text"], mode
    stats = _stats(dep.url)
    assert stats["pipelined_on"] and stats["flows"]["pipelined"] - before == len(MODES)
    counters = _endpoint_counters(dep.status_dir)
    # P published layers in part inside the forward; D started pulling before P had finished (concurrent flow)
    assert counters["partial_published"] > 0 and counters["early_pulls"] >= len(MODES)
    assert counters["pipelined_pulls"] > 0
    assert_idle(dep)


def test_a_proxy_whose_tickets_p_refuses_goes_the_sequential_way(dep):
    """A proxy signing with another key than the deployment's (as one whose clock is behind P's by over
    --params-ttl): real P refuses its pipelined tickets. The requests still succeed, the sequential way (P signs),
    with the sequential proxy's text, and nothing is left behind (before: every such request was a 400)."""
    prompt = _prompt(12, seed=7)
    want = complete(dep.seq_url, dep.model, prompt, "full", max_tokens=12)
    assert want["ok"], want
    for _ in range(3):  # learns P; its ticket refused -> sequential; P suspended -> sequential at once
        got = complete(dep.other_key_url, dep.model, prompt, "full", max_tokens=12)
        assert got["ok"], got
        assert got["out"]["choices"][0]["text"] == want["out"]["choices"][0]["text"]
    flows = _stats(dep.other_key_url)["flows"]
    assert flows["fallback"] == 1 and flows["pipelined"] == 1 and flows["sequential"] == 2, flows
    assert_idle(dep)


def test_client_leaving_before_p_finished_leaves_nothing_behind(dep):
    warm = complete(dep.url, dep.model, _prompt(4, seed=2), "full", max_tokens=2)  # the proxy learns P
    assert warm["ok"], warm
    before = _stats(dep.url)["flows"]["pipelined"]
    # ~800 tokens: P's forward takes seconds on a 2-core CPU, so both clients leave during it; P cannot stop a
    # forward midway (vLLM aborts between steps), so a much longer prompt would keep P busy past the next
    # request's concurrent_wait_s and fail it for a reason that is not under test
    prompt = _prompt(40, seed=3)
    body = json.dumps({"model": dep.model, "prompt": prompt, "max_tokens": 64, "temperature": 0,
                       "stream": True, "kv_transfer_params": {"lynx_mode": "speculative"}}).encode()
    host, port = dep.url.split("//")[1].split(":")
    for delay in (0.3, 1.0):  # during P's prefill
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(delay)
        # closed: the proxy cancels the calls to P and D
    assert _stats(dep.url)["flows"]["pipelined"] - before == 2  # both left in the pipelined flow
    assert_idle(dep)
    ok = complete(dep.url, dep.model, _prompt(20, seed=4), "speculative")
    assert ok["ok"], ok


def test_request_p_refuses_cancels_d_and_is_relayed(dep):
    res = complete(dep.url, dep.model, _prompt(30, seed=5), "no-such-mode")
    assert not res["ok"] and "HTTP 400" in res["error"] and "no-such-mode" in res["error"]
    assert_idle(dep)


def test_prefill_killed_mid_prefill_fails_that_request_and_the_next_succeed(dep):
    results: list[dict] = []
    prompt = _prompt(160, seed=6)

    def send():
        results.append(complete(dep.url, dep.model, prompt, "full", max_tokens=16, timeout=WAIT_S + 60))

    t = threading.Thread(target=send)
    t0 = time.monotonic()
    t.start()
    time.sleep(0.8)  # P is prefilling (and publishing layers)
    dep.dep.restart_prefill()  # SIGKILL, then the same command on the same ports
    t.join(timeout=WAIT_S + 90)
    assert not t.is_alive() and results
    # kv_load_failure_policy fail: the request fails, within D's deadlines (not at the proxy's 30-minute one)
    assert not results[0]["ok"], results[0]
    assert time.monotonic() - t0 < WAIT_S + 120
    for seed in (7, 8):  # the restarted P serves the next requests, through the pipelined flow again
        ok = complete(dep.url, dep.model, _prompt(20, seed=seed), "speculative")
        assert ok["ok"], ok
    assert_idle(dep)


def test_side_channel_params_cannot_be_chosen_by_a_client(dep):
    """A client that sends P concurrent-flow params itself (choosing the transfer id) is refused by P: only the
    proxy's signature makes P stage under a given id."""
    from lynx_connector.concurrent import prefill_params

    params = prefill_params("ab" * 16, "cd" * 16, "full")
    body = {"model": dep.model, "prompt": _prompt(10, seed=9), "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": params}
    req = urllib.request.Request(dep.dep.prefill.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    error = out["kv_transfer_params"]["lynx_error"]
    assert "concurrent-flow params refused" in error["message"] and error["code"] == 400
    assert "lynx_transfer_id" not in out["kv_transfer_params"]
    assert_idle(dep)


def test_prefill_stopped_by_sigterm_drains_then_tells_d(dep):
    """Last in this module: it stops P as Kubernetes does, SIGTERM to the server process only. With vLLM's
    --shutdown-timeout it drains: the request in flight completes, then P's workers close in order and P's side
    channel tells D it is shutting down (D's peer_closed), so D's pulls from it could not wait out timeout_s.
    (vLLM's default, abort, kills the workers at once: nothing is said, D's pulls fail at their deadline.)"""
    before = _endpoint_counters(dep.status_dir, ("partial_published", "peer_closed"))
    results: list[dict] = []
    t = threading.Thread(target=lambda: results.append(
        complete(dep.url, dep.model, _prompt(30, seed=11), "full", max_tokens=16, timeout=WAIT_S + 60)))
    t.start()
    end = time.monotonic() + 60
    while _endpoint_counters(dep.status_dir, ("partial_published",))["partial_published"] <= before["partial_published"]:
        assert time.monotonic() < end and t.is_alive(), results  # P has the request: it publishes its layers
        time.sleep(0.05)
    proc = dep.dep.prefill.proc
    os.kill(proc.pid, signal.SIGTERM)
    t.join(timeout=WAIT_S + 90)
    assert results and results[0]["ok"], results  # drained: served whole
    assert proc.wait(90) == 0
    end = time.monotonic() + 10
    while _endpoint_counters(dep.status_dir, ("peer_closed",))["peer_closed"] <= before["peer_closed"]:
        assert time.monotonic() < end, "D never heard that P was shutting down"
        time.sleep(0.1)
    log = dep.dep.prefill.log_path.read_text(errors="replace")
    assert "decode session(s) it is shutting down" in log
    dep.dep.prefill.stop()

