"""Issue 14.6 on real engines (real vLLM, real NIXL, the real model): D trusts only its prefill instances.

A client of D's API sends remote-prefill ``kv_transfer_params`` straight to D: unsigned, signed with another key,
P's real ones redirected to a port the test listens on, P's real ones for another prompt. D refuses each without
connecting anywhere (nothing ever connects to that port, D's transport never meets a peer for them), computes the
prompt locally (the same tokens as a plain run), says why in the response, and leaves nothing behind; the same
good params then still work. Blocks loaded in a lossy mode never serve a later request from D's prefix cache; a
lossless load still does. And P refuses a mode the operator did not allow.
"""

from __future__ import annotations

import secrets
import select
import socket
import time

import pytest

from tests.integration.engines import EngineProcess, lynx_kv_config

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(900)]

MAX_TOKENS = 8
PROBES = "tests.integration.trust_probes:state"
#: The production default (full, speculative, bf16) plus one lossy baseline the operator allows explicitly.
ALLOWED = "full,speculative,bf16,int8"


@pytest.fixture(scope="module")
def prompts(model):
    """Four essay windows of 10 blocks + 1 token, with no common prefix (so prefix-cache hits are the test's)."""
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import perplexity_windows

    return perplexity_windows(AutoTokenizer.from_pretrained(model), 321, 4)


@pytest.fixture(scope="module")
def engines(model):
    started = []
    try:
        p = EngineProcess(model, lynx_kv_config("full", allowed_modes=ALLOWED), cpu="0")
        started.append(p)
        d = EngineProcess(model, lynx_kv_config("full", allowed_modes=ALLOWED), cpu="1",
                          enable_prefix_caching=True)
        started.append(d)
        yield p, d, p.call(PROBES), d.call(PROBES)
    finally:
        for e in reversed(started):
            e.close()


@pytest.fixture()
def listener():
    """A TCP port on 127.0.0.1 that nothing may connect to (forged params point D at it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def prefill(p, ids, mode="full"):
    out = p.generate([ids], [{"do_remote_decode": True, "lynx_mode": mode}], max_tokens=1)[0]
    return out["kv_transfer_params"]


def wait_idle(engine, baseline, what):
    deadline = time.monotonic() + 60
    while True:
        now = engine.call(PROBES)
        idle = {k: v for k, v in now.items() if k != "peers"} == {k: v for k, v in baseline.items() if k != "peers"}
        if idle or time.monotonic() > deadline:
            assert idle, (what, now, baseline)
            return now
        time.sleep(0.5)


def test_forged_params_sent_straight_to_d_are_refused_without_connecting(engines, prompts, listener):
    from lynx_connector.metadata import RemotePrefill, mint_ticket
    from lynx_connector.signing import ParamsSigner

    p, d, p_idle, d_idle = engines
    port = listener.getsockname()[1]
    a, b = prompts[0], prompts[1]  # every refused request uses a; P's real params are for b
    plain = d.generate([a], max_tokens=MAX_TOKENS)[0]  # D computing the prompt itself
    tid, token = mint_ticket()
    forged = RemotePrefill(engine_id="evil", request_id="x", host="127.0.0.1", ports=(port,), num_tokens=len(a),
                           mode="full", transfer_id=tid, token=token).to_params()
    real = prefill(p, b)
    assert real["lynx_sig"] and real["lynx_prompt_sha"], real
    redirected = {**real, "remote_host": "127.0.0.1", "remote_port": port, "lynx_ports": [port]}
    cases = [("unsigned", forged, "unsigned"),
             ("another key", ParamsSigner(secrets.token_bytes(32), 60).sign(forged), "bad_signature"),
             ("P's, redirected", redirected, "bad_signature"),
             ("P's, for another prompt", real, "prompt_mismatch")]
    for what, params, reason in cases:
        out = d.generate([a], [dict(params)], max_tokens=MAX_TOKENS)[0]
        err = (out["kv_transfer_params"] or {}).get("lynx_error")
        assert err and err["reason"] == reason, (what, out["kv_transfer_params"])
        assert out["token_ids"] == plain["token_ids"], what  # served all the same, from D's own prefill
    # nobody connected to the port the forged params named, and D's transport met no peer at all
    assert select.select([listener], [], [], 1.0)[0] == [], "D connected where forged params pointed it"
    state = wait_idle(d, d_idle, "D after the refusals")
    assert state["peers"] == d_idle["peers"], state
    # P's params for b were not consumed by any of that: with their own prompt they load P's KV, and then
    # everything is released on both sides
    ok = d.generate([b], [dict(real)], max_tokens=MAX_TOKENS)[0]
    assert not (ok["kv_transfer_params"] or {}).get("lynx_error"), ok["kv_transfer_params"]
    assert d.call(PROBES)["peers"] == d_idle["peers"] + 1  # D met P (and only P)
    wait_idle(d, d_idle, "D after the good request")
    wait_idle(p, p_idle, "P after D pulled")


def test_lossy_blocks_never_serve_a_later_request_from_ds_prefix_cache(engines, prompts):
    p, d, _, d_idle = engines
    lossy, lossless = prompts[2], prompts[3]
    params = prefill(p, lossy, "int8")
    assert params["lynx_mode"] == "int8"
    out = d.generate([lossy], [params], max_tokens=MAX_TOKENS)[0]
    assert not (out["kv_transfer_params"] or {}).get("lynx_error")
    again = d.generate([lossy], max_tokens=MAX_TOKENS)[0]  # a plain local request, same prompt
    assert again["num_cached_tokens"] == 0, again["num_cached_tokens"]
    # the lossless mode is cached as before: the plain request hits every full block D loaded
    params = prefill(p, lossless, "full")
    d.generate([lossless], [params], max_tokens=MAX_TOKENS)
    again = d.generate([lossless], max_tokens=MAX_TOKENS)[0]
    assert again["num_cached_tokens"] == len(lossless) - 1, again["num_cached_tokens"]
    wait_idle(d, d_idle, "D after the loads")


def test_prefill_refuses_a_mode_the_operator_did_not_allow(engines, prompts):
    p, _, p_idle, _ = engines
    out = p.generate([prompts[0]], [{"do_remote_decode": True, "lynx_mode": "int4"}], max_tokens=1)[0]
    err = out["kv_transfer_params"]["lynx_error"]
    assert err["code"] == 400 and "int4" in err["message"] and "allowed_modes" in err["message"], err
    assert "do_remote_prefill" not in out["kv_transfer_params"]
    wait_idle(p, p_idle, "P after the refusal")  # nothing staged, blocks freed
