"""`lynx proxy` as vLLM's OpenAI surface, against real `lynx serve` P and D (the real model, KV over real NIXL):
vLLM's own 4xx bodies reach the client byte for byte, a client that disconnects mid-generation makes D abort the
request (D idle again, the next request served), and the speculation summary reaches only clients that ask."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from lynx_connector.lab.launch import Deployment
    from lynx_connector.lab.models import is_prepared, model_dir

    if not is_prepared():
        pytest.skip("the real model is not prepared (scripts/setup_env.sh prepares it)")
    # speculative on both (the preset gives D the Lynx scheduler): the summary exists to be asked for or not
    cfg = json.dumps({"kv_connector": "lynx:speculative", "kv_connector_extra_config": {"lease_s": 60}})
    # D logs its aborts (--enable-log-requests): vLLM does not count client aborts in vllm:request_success_total
    with Deployment(str(model_dir()), tmp_path_factory.mktemp("servers"), kv_transfer_config=cfg,
                    max_model_len=4096, decode_serve_args=["--enable-log-requests"]) as dep:
        yield dep


@pytest.fixture(scope="module")
def model(deployment):
    from lynx_connector.lab.models import model_dir

    return str(model_dir())


def raw_post(url: str, body: dict, timeout: float = 300, request_id: str | None = None) -> tuple[int, bytes, dict]:
    """Status, body bytes and headers, error answers included."""
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def metric(server_url: str, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(server_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        if labels in m.group(1):
            total += float(m.group(2))
    return total


def aborted_on_d(deployment, request_id: str) -> bool:
    """D's vLLM logged the abort of the request whose X-Request-Id was ``request_id`` ("Aborted request(s)
    cmpl-<id>-..." / "Request cmpl-<id>-... aborted.", with --enable-log-requests)."""
    return any("borted" in line and f"cmpl-{request_id}-" in line
               for line in deployment.decode.log_path.read_text(errors="replace").splitlines())


def wait_for(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.2)
    return time.monotonic() - t0


def test_vllm_error_bodies_pass_through_byte_identical(deployment, model):
    """A 400 from D (max_tokens beyond the context), a 400 from P (a bad sampling parameter, P validates first)
    and a 404 (unknown model) are the bytes D itself answers to the same request."""
    cases = [({"model": model, "prompt": "Hello", "max_tokens": 100000}, 400),
             ({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": -1}, 400),
             ({"model": "no-such-model", "prompt": "Hello", "max_tokens": 4}, 404)]
    for body, status in cases:
        for stream in (False, True):
            b = dict(body, stream=stream)
            direct = raw_post(deployment.decode.url + "/v1/completions", b)
            proxied = raw_post(deployment.url + "/v1/completions", b)
            assert direct[0] == proxied[0] == status, (direct, proxied)
            assert proxied[1] == direct[1], (proxied[1], direct[1])
            assert json.loads(proxied[1])["error"]["code"] == status
            assert proxied[2]["X-Request-Id"].startswith("lynx-")
    chat = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    direct = raw_post(deployment.decode.url + "/v1/chat/completions", chat)
    proxied = raw_post(deployment.url + "/v1/chat/completions", chat)
    assert direct[0] == proxied[0] == 404 and direct[1] == proxied[1]


def test_client_disconnect_mid_stream_aborts_on_d(deployment, model):
    """A streaming client that goes away mid-generation: the proxy closes D's call, D aborts the request (vLLM
    counts it as an abort; nothing left running or waiting), the proxy logs it as a disconnect without a
    traceback, and the next request is served."""
    d = deployment.decode.url
    finished0 = metric(d, "vllm:request_success_total")
    body = {"model": model, "prompt": "Count from one to one thousand: one, two,", "max_tokens": 3000,
            "ignore_eos": True, "temperature": 0, "stream": True}
    u = urllib.parse.urlsplit(deployment.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                               "X-Request-Id": "disconnect-test-1"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("X-Request-Id") == "disconnect-test-1"
    events = 0
    while events < 5:
        line = resp.fp.readline()
        assert line, "stream ended early"
        events += line.startswith(b"data: ")
    assert metric(d, "vllm:num_requests_running") == 1 and metric(d, "vllm:kv_cache_usage_perc") > 0
    conn.sock.close()  # the client goes away, 3000 tokens from the end
    conn.close()
    waited = wait_for(lambda: metric(d, "vllm:num_requests_running") == 0, 30, "D still runs the request")
    assert metric(d, "vllm:num_requests_waiting") == 0
    wait_for(lambda: aborted_on_d(deployment, "disconnect-test-1"), 10, "D did not abort the request")
    wait_for(lambda: metric(d, "vllm:kv_cache_usage_perc") == 0, 10, "D's blocks were not freed")
    assert metric(d, "vllm:request_success_total") == finished0  # aborted, not finished
    print(f"D idle {waited:.1f}s after the client disconnected")
    log = deployment.proxy.log_path.read_text()
    gone = [line for line in log.splitlines() if "disconnect-test-1" in line]
    assert any("client disconnected" in line and "decode stream" in line for line in gone), gone
    assert "Traceback" not in log and not any("failed" in line for line in gone), log[-3000:]
    status, out, _ = raw_post(deployment.url + "/v1/completions",
                              {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                               "temperature": 0})
    assert status == 200 and "Paris" in json.loads(out)["choices"][0]["text"], out


def test_client_disconnect_before_d_answers_aborts_on_d(deployment, model):
    """Not streaming: a client that gives up while D generates makes D abort too (vLLM's non-streaming
    handler is cancelled when its connection closes)."""
    d = deployment.decode.url
    finished0 = metric(d, "vllm:request_success_total")
    body = {"model": model, "prompt": "Count from one to one thousand: one, two,", "max_tokens": 3000,
            "ignore_eos": True, "temperature": 0}
    with pytest.raises((TimeoutError, OSError)):
        raw_post(deployment.url + "/v1/completions", body, timeout=8, request_id="disconnect-test-2")
    wait_for(lambda: aborted_on_d(deployment, "disconnect-test-2"), 30, "D did not abort the request")
    wait_for(lambda: metric(d, "vllm:num_requests_running") == 0, 10, "D still runs the request")
    wait_for(lambda: metric(d, "vllm:kv_cache_usage_perc") == 0, 10, "D's blocks were not freed")
    assert metric(d, "vllm:request_success_total") == finished0
    log = deployment.proxy.log_path.read_text()
    assert any("disconnect-test-2" in line and "client disconnected" in line for line in log.splitlines())


def test_speculation_summary_only_when_asked_for(deployment, model):
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    status, quiet, _ = raw_post(deployment.url + "/v1/completions", body)
    assert status == 200 and json.loads(quiet)["kv_transfer_params"] is None, quiet
    status, asked, _ = raw_post(deployment.url + "/v1/completions",
                                dict(body, kv_transfer_params={"lynx_report": True}))
    summary = json.loads(asked)["kv_transfer_params"]["lynx_speculation"]
    assert status == 200 and summary["dropped"] == 0 and summary["accepted"] + summary["rejected"] == summary["speculated"], asked
    assert json.loads(asked)["choices"][0]["text"] == json.loads(quiet)["choices"][0]["text"]
