"""Lynx behind vLLM's production router, the scale-out path: real `lynx serve` servers (two P, one D) with the
real model, KV over real NIXL, and `vllm-router --vllm-pd-disaggregation` (PyPI vllm-router, installed by the
dev extra) in front of them, 1P1D and 2P1D, with concurrent requests (completions, streamed completions, chat).

Checked for every batch: each answer equals the one `lynx proxy` gives for the same request (greedy); D
computed none of the prompt tokens itself (vLLM's `vllm:prompt_tokens_by_source_total`: `local_compute` did not
move, `external_kv_transfer` grew by exactly the batch's prompt tokens) and pulled both Lynx planes
(`vllm:lynx_transfer_bytes_total` anchor and residual); the P servers the router was given did the prefills
(with 2P1D both of them, together exactly the batch's prompt tokens). One Deployment serves all of it: P1, D
and the proxy, plus a second P and two routers (one with P1 only, one with both Ps), all in the speculative mode
that examples/k8s/xpyd.yaml deploys."""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(600)]

#: Four distinct requests of 40-150 prompt tokens (several KV blocks of 32): two completions, one streamed
#: completion and one chat, all greedy; sent at once.
PROMPTS = [
    "The printing press, invented by Johannes Gutenberg around 1440, changed how knowledge spread across Europe. "
    "Books that had taken scribes months to copy could now be produced in days, and their prices fell. Literacy "
    "rose, universities grew, and new ideas in science and religion reached readers far from where they began. "
    "Historians still debate which of these effects mattered most, but most agree that",
    "Recipe for a simple tomato soup. Ingredients: six ripe tomatoes, one onion, two cloves of garlic, olive oil, "
    "salt, pepper and a litre of vegetable stock. Step one:",
    "A lighthouse keeper wrote in his log on a stormy night: the lamp is lit, the waves are higher than the rail, "
    "and a small boat is trying to reach the harbour. At midnight",
]
CHAT = ("Here is a short note about the water cycle: water evaporates from oceans and lakes, condenses into clouds "
        "and falls back as rain or snow. Explain in one sentence why clouds form.")
MAX_TOKENS = 12


def _post(url: str, body: dict[str, Any], timeout: float = 180) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _requests(model: str) -> list[tuple[str, dict[str, Any]]]:
    base = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
    return [
        ("/v1/completions", {**base, "prompt": PROMPTS[0]}),
        ("/v1/completions", {**base, "prompt": PROMPTS[1], "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": CHAT}]}),
        ("/v1/completions", {**base, "prompt": PROMPTS[2]}),
    ]


def _answer(status: int, raw: bytes, stream: bool) -> tuple[str, int]:
    """(generated text, prompt tokens) of one response; fails the test on an error."""
    assert status == 200, (status, raw[:500])
    if not stream:
        out = json.loads(raw)
        choice = out["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, out["usage"]["prompt_tokens"]
    text, prompt_tokens = "", None
    for line in raw.decode().splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        chunk = json.loads(line[5:])
        assert "error" not in chunk, chunk
        text += "".join(c.get("text") or "" for c in chunk.get("choices", []))
        if chunk.get("usage"):
            prompt_tokens = chunk["usage"]["prompt_tokens"]
    assert prompt_tokens is not None, raw[-500:]
    return text, prompt_tokens


def _batch(url: str, model: str) -> list[tuple[str, int]]:
    """Send the four requests at once to ``url``; their (text, prompt tokens) in order."""
    reqs = _requests(model)
    with ThreadPoolExecutor(len(reqs)) as pool:
        futures = [pool.submit(_post, url + path, body) for path, body in reqs]
        results = [f.result() for f in futures]
    answers = [_answer(status, raw, bool(body.get("stream"))) for (status, raw), (_, body) in zip(results, reqs,
                                                                                                 strict=True)]
    for text, _ in answers:
        assert text.strip(), answers
    return answers


_SAMPLE = re.compile(r"^(vllm:[a-z_]+)\{([^}]*)\} ([0-9.e+-]+)$", re.M)


def _metrics(server) -> dict[tuple[str, str], float]:
    """``{(name, source or stream label): value}`` of the counters this test reads from ``server``'s /metrics."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, str], float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        if name in ("vllm:prompt_tokens_total", "vllm:prompt_tokens_by_source_total",
                    "vllm:lynx_transfer_bytes_total"):
            label = re.search(r'(?:source|stream)="(\w+)"', labels)
            key = (name, label.group(1) if label else "")
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _delta(before: dict, after: dict, name: str, label: str = "") -> float:
    return after.get((name, label), 0.0) - before.get((name, label), 0.0)


def _settled(servers, before: dict, expected_prompt_tokens: int, timeout: float = 30.0) -> dict:
    """The servers' metrics once D's prompt-token counter has taken in the whole batch (vLLM's stat loggers run
    next to the response, so the last request may lag its answer by a moment)."""
    d = servers["decode"]
    deadline = time.monotonic() + timeout
    while True:
        after = {name: _metrics(s) for name, s in servers.items()}
        got = _delta(before[d.name], after[d.name], "vllm:prompt_tokens_total")
        if got >= expected_prompt_tokens or time.monotonic() > deadline:
            return after
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model):
    from lynx_connector.lab.launch import Deployment
    from lynx_connector.lab.router import add_prefill, router_installed, router_server, wait_healthy
    if not router_installed():
        pytest.fail("vllm-router is not installed: scripts/setup_env.sh installs it with the dev extra")
    logs = tmp_path_factory.mktemp("router")
    cfg = "lynx:speculative"  # what examples/k8s/xpyd.yaml deploys; pulls anchor and residual like full
    dep = Deployment(model, logs, kv_transfer_config=cfg, max_model_len=1024)
    p2 = add_prefill(dep, "prefill-2", model, cfg, max_model_len=1024)
    with dep, contextlib.ExitStack() as stack:
        routers = {
            "1p1d": router_server("router-1p1d", logs, [dep.prefill.url], [dep.decode.url],
                                  extra=["--disable-retries"]),
            "2p1d": router_server("router-2p1d", logs, [dep.prefill.url, p2.url], [dep.decode.url],
                                  extra=["--disable-retries"]),
        }
        for r in routers.values():
            stack.callback(r.stop)
            r.start()
        for r in routers.values():
            wait_healthy(r, 120)
        yield {"dep": dep, "p2": p2, "routers": routers, "model": model}


@pytest.fixture(scope="module")
def reference(stack):
    """The proxy's answers to the batch (sent at once, like the routers' batches)."""
    return [text for text, _ in _batch(stack["dep"].url, stack["model"])]


def _servers(stack) -> dict[str, Any]:
    dep = stack["dep"]
    return {"prefill": dep.prefill, "prefill-2": stack["p2"], "decode": dep.decode}


def _run_through_router(stack, which: str) -> tuple[dict, dict, list[tuple[str, int]]]:
    servers = _servers(stack)
    before = {s.name: _metrics(s) for s in servers.values()}
    answers = _batch(stack["routers"][which].url, stack["model"])
    total = sum(n for _, n in answers)
    after = _settled(servers, before, total)
    return before, after, answers


def _assert_d_pulled_everything(before: dict, after: dict, total: int) -> None:
    b, a = before["decode"], after["decode"]
    assert _delta(b, a, "vllm:prompt_tokens_total") == total
    # no prompt token computed on D: every one came over the connector
    assert _delta(b, a, "vllm:prompt_tokens_by_source_total", "local_compute") == 0
    assert _delta(b, a, "vllm:prompt_tokens_by_source_total", "external_kv_transfer") == total
    assert _delta(b, a, "vllm:lynx_transfer_bytes_total", "anchor") > 0
    assert _delta(b, a, "vllm:lynx_transfer_bytes_total", "residual") > 0


def test_1p1d_behind_vllm_router(stack, reference):
    before, after, answers = _run_through_router(stack, "1p1d")
    assert [text for text, _ in answers] == reference
    total = sum(n for _, n in answers)
    _assert_d_pulled_everything(before, after, total)
    assert _delta(before["prefill"], after["prefill"], "vllm:prompt_tokens_total") == total
    assert _delta(before["prefill-2"], after["prefill-2"], "vllm:prompt_tokens_total") == 0


def test_2p1d_behind_vllm_router(stack, reference):
    before, after, answers = _run_through_router(stack, "2p1d")
    assert [text for text, _ in answers] == reference
    total = sum(n for _, n in answers)
    _assert_d_pulled_everything(before, after, total)
    p1 = _delta(before["prefill"], after["prefill"], "vllm:prompt_tokens_total")
    p2 = _delta(before["prefill-2"], after["prefill-2"], "vllm:prompt_tokens_total")
    assert p1 > 0 and p2 > 0 and p1 + p2 == total, (p1, p2, total)  # round robin over both P


def test_vllm_router_replaces_the_clients_kv_transfer_params(stack):
    """What docs/OPERATIONS.md says of this router: it sends P its own kv_transfer_params, so a client's
    `lynx_mode` never reaches P and the servers' default mode (here full: anchor and residual) applies. Through
    `lynx proxy` the same request is served in the mode it names (bf16, one of the default `allowed_modes`: one
    plane, no residual)."""
    servers = _servers(stack)
    body = {"model": stack["model"], "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0,
            "kv_transfer_params": {"lynx_mode": "bf16"}}
    for url, residual_expected in ((stack["routers"]["1p1d"].url, True), (stack["dep"].url, False)):
        before = {s.name: _metrics(s) for s in servers.values()}
        status, raw = _post(url + "/v1/completions", body)
        _, prompt_tokens = _answer(status, raw, stream=False)
        after = _settled(servers, before, prompt_tokens)
        b, a = before["decode"], after["decode"]
        assert _delta(b, a, "vllm:prompt_tokens_by_source_total", "local_compute") == 0  # pulled either way
        assert _delta(b, a, "vllm:lynx_transfer_bytes_total", "anchor") > 0
        residual = _delta(b, a, "vllm:lynx_transfer_bytes_total", "residual")
        assert (residual > 0) == residual_expected, (url, residual)


def test_local_compute_counts_a_prompt_d_computes_itself(stack):
    """The check above can fail: a request sent to D without P's kv_transfer_params is prefilled on D, and
    `local_compute` counts its prompt."""
    servers = _servers(stack)
    before = {s.name: _metrics(s) for s in servers.values()}
    status, raw = _post(stack["dep"].decode.url + "/v1/completions",
                        {"model": stack["model"], "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0})
    _, prompt_tokens = _answer(status, raw, stream=False)
    after = _settled(servers, before, prompt_tokens)
    b, a = before["decode"], after["decode"]
    assert _delta(b, a, "vllm:prompt_tokens_by_source_total", "local_compute") == prompt_tokens > 0
    assert _delta(b, a, "vllm:prompt_tokens_by_source_total", "external_kv_transfer") == 0


@pytest.mark.parametrize("n, stream", [(2, False), (4, True)])
def test_n_children_behind_vllm_router(stack, n, stream):
    """n > 1 behind vllm-router (issue 18.1): the router forwards n to P, P stages each child and lists them in
    its params (lynx_children), the router relays them to D, and every D child pulls its own P child: all n
    answered like through `lynx proxy` (greedy: top_k=1, as vLLM refuses n > 1 at temperature 0), D computes no
    prompt token itself."""
    servers = _servers(stack)
    body = {"model": stack["model"], "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "n": n, "temperature": 1.0,
            "top_k": 1, "stream": stream}

    def texts(url: str) -> list[str]:
        status, raw = _post(url + "/v1/completions", body)
        assert status == 200, (status, raw[:500])
        if not stream:
            return sorted(c["text"] for c in json.loads(raw)["choices"])
        out = [""] * n
        for line in raw.decode().splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                for c in json.loads(line[5:]).get("choices", []):
                    out[c["index"]] += c.get("text") or ""
        return sorted(out)

    before = {s.name: _metrics(s) for s in servers.values()}
    routed = texts(stack["routers"]["1p1d"].url)
    b = before["decode"]
    deadline = time.monotonic() + 30
    while (a := _metrics(servers["decode"])) and _delta(b, a, "vllm:prompt_tokens_by_source_total",
                                                        "external_kv_transfer") <= 0:
        assert time.monotonic() < deadline, "D never counted the children's pulled prompt tokens"
        time.sleep(0.5)
    time.sleep(2.0)  # every child's stats, not only the first's
    a = _metrics(servers["decode"])
    assert _delta(b, a, "vllm:prompt_tokens_by_source_total", "local_compute") == 0  # every child pulled its KV
    assert len(routed) == n and all(t.strip() for t in routed), routed
    assert routed == texts(stack["dep"].url)  # the same children through lynx proxy
