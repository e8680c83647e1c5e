"""Servers on separate "hosts": `lynx serve` P and D and the proxy, each in its own network namespace
(`Deployment(netns=True)`), KV over the P-D veth with UCX on TCP. Slow: three vLLM servers start on a loaded box."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from lynx_connector.lab import netns
from lynx_connector.lab.launch import Deployment, NetnsPlan, http_json, with_side_channel_host
from lynx_connector.transport.nixl_wrapper import nixl_available

_ok, _why = netns.available()
needs_netns = pytest.mark.skipif(not _ok, reason=f"network namespaces: {_why}")

TIMEOUT_S, LEASE_S = 5, 10
KV_CONFIG = json.dumps({"kv_connector": "lynx", "kv_load_failure_policy": "fail",
                        "kv_connector_extra_config": {"timeout_s": TIMEOUT_S, "lease_s": LEASE_S}})
PROMPT = ("Here are some facts. The Eiffel Tower is in Paris. The Colosseum is in Rome. The Brandenburg Gate is in "
          "Berlin. Big Ben is in London. The Sagrada Familia is in Barcelona. " * 6
          + "Question: In which city is the Colosseum? Answer: The Colosseum is in")


def test_netns_plan_addresses_and_side_channel() -> None:
    """Cheap: P binds/advertises its side channel on the P-D link, UCX is pinned to that veth over TCP,
    the proxy points at the servers' addresses on the proxy links."""
    dep = Deployment("MODEL", Path("/tmp/lynx-plan-test"), netns=True, link_mbit=500)
    p, d, x = dep.prefill, dep.decode, dep.proxy
    assert NetnsPlan.addr("p", "d") == "10.213.3.1" and NetnsPlan.addr("d", "p") == "10.213.3.2"
    assert '"side_channel_host": "10.213.3.1"' in p.argv[-1] and '"mode": "full"' in p.argv[-1]
    assert p.env["UCX_TLS"] == "tcp" and p.env["UCX_NET_DEVICES"] == "to-d" and d.env["UCX_NET_DEVICES"] == "to-p"
    assert x.argv[x.argv.index("--prefill") + 1] == "http://10.213.1.2:8100"
    assert x.argv[x.argv.index("--decode") + 1] == "http://10.213.2.2:8200"
    assert dep.topology is None  # nothing is created before start()
    with pytest.raises(ValueError, match="netns"):
        Deployment("MODEL", Path("/tmp/lynx-plan-test"), link_mbit=500)
    assert '"link_gbps": 1' in with_side_channel_host('{"kv_connector": "lynx", "kv_connector_extra_config": '
                                                      '{"link_gbps": 1}}', "10.0.0.1")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from lynx_connector.lab.models import is_prepared, model_dir

    if not is_prepared():
        pytest.skip("the real model is not prepared (scripts/setup_env.sh prepares it)")
    log_dir = tmp_path_factory.mktemp("netns-serve")
    dep = Deployment(str(model_dir()), log_dir, netns=True, startup_timeout=600, kv_transfer_config=KV_CONFIG)
    for server in dep.servers:  # a small KV cache: the shared box has little memory to spare
        server.env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with dep:
        names = list(dep.topology.namespaces)
        yield dep
    assert not set(names) & set(netns.list_namespaces())  # stop() deleted them


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.netns
@needs_netns
@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
@pytest.mark.timeout(1200)
def test_request_answered_across_the_veth(deployment: Deployment) -> None:
    """A completion through the proxy (namespace x) whose KV P ships to D over the P-D veth: the answer is right,
    equals P's own local greedy answer, and the KV bytes were counted on that veth."""
    dep = deployment
    ns, dev = dep.kv_link
    before = dep.topology.counters(ns, dev)
    body = {"model": dep.prefill.argv[dep.prefill.argv.index("serve") + 1], "prompt": PROMPT, "max_tokens": 6,
            "temperature": 0.0}
    with dep.client():
        out = http_json(dep.url + "/v1/completions", body, timeout=300)
    text = out["choices"][0]["text"]
    after = dep.topology.counters(ns, dev)
    with dep.prefill.reach():
        local = http_json(dep.prefill.url + "/v1/completions", body, timeout=300)["choices"][0]["text"]
    assert "Rome" in text, text
    assert text == local, (text, local)
    assert after["tx_bytes"] - before["tx_bytes"] > 200_000, (before, after)  # ~1 MB of Lynx KV for ~300 tokens


def _kv_usage(server) -> float:
    with server.reach(), urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M))


def _wait_blocks_free(dep: Deployment, within: float) -> None:
    end = time.monotonic() + within
    while (usage := (_kv_usage(dep.prefill), _kv_usage(dep.decode))) != (0.0, 0.0):
        assert time.monotonic() < end, f"KV blocks still held (P, D): {usage}"
        time.sleep(1.0)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.netns
@needs_netns
@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
@pytest.mark.timeout(1200)
def test_link_cut_gives_a_clear_error_then_recovers(deployment: Deployment) -> None:
    """The P-D veth blackholed (both directions) before a request: P prefills, D's pull stalls, after timeout_s
    kv_load_failure_policy=fail ends the request and the proxy answers with an OpenAI-style JSON error naming
    the decode side (no hang). Blocks on P (held for D, freed by lease_s) and D return to 0; with the link back,
    the same request is answered correctly."""
    dep = deployment
    ns, dev = dep.kv_link
    body = {"model": dep.prefill.argv[dep.prefill.argv.index("serve") + 1], "prompt": PROMPT, "max_tokens": 6,
            "temperature": 0.0}
    dep.topology.blackhole(ns, dev)
    dep.topology.blackhole(dep.decode.netns, "to-p")
    try:
        t0 = time.monotonic()
        with dep.client(), pytest.raises(urllib.error.HTTPError) as err:
            http_json(dep.url + "/v1/completions", body, timeout=TIMEOUT_S + 40)
        elapsed = time.monotonic() - t0
        payload = json.loads(err.value.read() or b"{}")
        assert err.value.code >= 500 and "decode" in json.dumps(payload), (err.value.code, payload)
        assert elapsed < TIMEOUT_S + 60, elapsed
    finally:
        dep.topology.blackhole(ns, dev, on=False)
        dep.topology.blackhole(dep.decode.netns, "to-p", on=False)
    _wait_blocks_free(dep, LEASE_S + 30)
    with dep.client():
        out = http_json(dep.url + "/v1/completions", body, timeout=300)
    assert "Rome" in out["choices"][0]["text"], out
    _wait_blocks_free(dep, 30)
