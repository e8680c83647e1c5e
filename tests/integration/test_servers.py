"""The deployment users run: real `lynx serve` prefill and decode servers (vLLM's OpenAI server + the plugin's
`--kv-transfer-config lynx` preset) and `lynx proxy`, with the real model, over HTTP, KV over real NIXL."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, model):
    from lynx_connector.lab.launch import Deployment
    cfg = json.dumps({"kv_connector": "lynx",
                      "kv_connector_extra_config": {"mode": "full", "link_gbps": 0.5, "lease_s": 60,
                                                    "allowed_modes": "full,speculative,bf16,int8,auto"}})
    with Deployment(model, tmp_path_factory.mktemp("servers"), kv_transfer_config=cfg,
                    max_model_len=4096) as dep:
        yield dep


@pytest.fixture(scope="module")
def needle(deployment):
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_needle_prompt
    from lynx_connector.lab.models import model_dir

    return build_needle_prompt(AutoTokenizer.from_pretrained(str(model_dir())), 1200, depth=0.5, seed=7)


def post(url, body, timeout=300):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("mode", ["full", "int8"])
def test_completion_through_the_proxy_finds_the_needle(deployment, needle, mode):
    from lynx_connector.lab.models import model_dir

    out = post(deployment.url + "/v1/completions", {
        "model": str(model_dir()), "prompt": needle.token_ids, "max_tokens": 12, "temperature": 0,
        "kv_transfer_params": {"lynx_mode": mode}})
    assert needle.answer in out["choices"][0]["text"], out


def test_auto_mode_is_served_and_its_choice_reported(deployment, needle):
    """Issue 16.3: ``lynx_mode: auto`` through the proxy. P (link_gbps 0.5, no speculative scheduler) estimates
    the 1200-token prompt's passthrough at ~0.9 s on the link against ~0.25 s for Lynx full, so it picks full
    (speculative is no candidate without the scheduler); D reports the signed choice in its final output, P logs
    and counts it."""
    from lynx_connector.auto import AUTO_REASONS
    from lynx_connector.lab.models import model_dir

    out = post(deployment.url + "/v1/completions", {
        "model": str(model_dir()), "prompt": needle.token_ids, "max_tokens": 12, "temperature": 0,
        "kv_transfer_params": {"lynx_mode": "auto"}})
    assert needle.answer in out["choices"][0]["text"], out
    chosen = (out.get("kv_transfer_params") or {}).get("lynx_auto")
    assert chosen == {"mode": "full", "reason": "slow_link_no_speculation"}, out.get("kv_transfer_params")
    assert chosen["reason"] in AUTO_REASONS
    assert re.search(r"auto chose full \(slow_link_no_speculation\): link 0.5 Gbit/s \(configured\)",
                     deployment.prefill.log_path.read_text())
    deadline = time.monotonic() + 30
    pattern = (r'vllm:lynx_auto_choices_total\{[^}]*mode="full"[^}]*reason="slow_link_no_speculation"[^}]*\} '
               r'[1-9]')
    while True:
        with urllib.request.urlopen(deployment.prefill.url + "/metrics", timeout=10) as resp:
            if re.search(pattern, resp.read().decode()):
                break
        assert time.monotonic() < deadline, "P did not export vllm:lynx_auto_choices"
        time.sleep(1)


def test_streaming_chat_through_the_proxy(deployment):
    from lynx_connector.lab.client import stream_completion
    from lynx_connector.lab.models import model_dir

    res = stream_completion(deployment.url, str(model_dir()), "The capital of France is", max_tokens=8)
    assert res.error is None and "Paris" in res.text
    assert res.ttft is not None and len(res.token_times) >= 2


def test_metrics_are_exported(deployment, needle):
    from lynx_connector.lab.models import model_dir

    post(deployment.url + "/v1/completions", {"model": str(model_dir()), "prompt": needle.token_ids,
                                              "max_tokens": 2, "kv_transfer_params": {"lynx_mode": "full"}})
    with urllib.request.urlopen(deployment.decode.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert re.search(r'vllm:lynx_transfer_bytes_total\{[^}]*stream="anchor"[^}]*\} [1-9]', metrics), metrics[-2000:]
    assert re.search(r'vllm:lynx_transfer_bytes_total\{[^}]*stream="residual"[^}]*\} [1-9]', metrics)
    # staging occupancy of each side, per worker (exported about once a second)
    assert re.search(r'vllm:lynx_staging_bytes\{[^}]*side="d"[^}]*state="capacity"[^}]*\} [1-9]', metrics), metrics[-3000:]
    with urllib.request.urlopen(deployment.prefill.url + "/metrics", timeout=10) as resp:
        p_metrics = resp.read().decode()
    assert re.search(r'vllm:lynx_staging_bytes\{[^}]*side="p"[^}]*state="capacity"[^}]*\} [1-9]', p_metrics)
    deadline = time.monotonic() + 60  # the "KV Transfer metrics" line is logged every ~10 s
    while time.monotonic() < deadline:
        d_log = deployment.decode.log_path.read_text()
        p_log = deployment.prefill.log_path.read_text()
        if "KV Transfer metrics: Num pulls=" in d_log and re.search(r"KV Transfer metrics: .*Num encodes=[1-9]",
                                                                    p_log):
            break
        time.sleep(2)
    else:
        pytest.fail("no 'KV Transfer metrics' line with pulls on D and encodes on P")


def test_client_abort_while_kv_in_flight_releases_everything(deployment, needle):
    """The client goes away while D is still pulling (bf16 over a 0.5 Gbit/s link takes seconds): D cancels
    the pull and tells P, and the servers keep serving."""
    from lynx_connector.lab.models import model_dir

    model = str(model_dir())
    pre = post(deployment.prefill.url + "/v1/completions", {
        "model": model, "prompt": needle.token_ids, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "lynx_mode": "bf16"}})
    body = json.dumps({"model": model, "prompt": needle.token_ids, "max_tokens": 8,
                       "kv_transfer_params": pre["kv_transfer_params"]}).encode()
    req = urllib.request.Request(deployment.decode.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:  # ~55 MB at 0.5 Gbit/s: about a second of transfer; hang up well before
        urllib.request.urlopen(req, timeout=0.3).read()
    except (TimeoutError, OSError):
        pass
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if "ended (finished or aborted) while its KV was in flight" in deployment.decode.log_path.read_text():
            break
        time.sleep(1)
    else:
        pytest.fail("D did not report the aborted pull")
    # and the deployment still serves
    test_completion_through_the_proxy_finds_the_needle(deployment, needle, "full")


def test_a_mode_the_operator_does_not_allow_is_a_400_and_unsigned_params_are_refused_and_counted(deployment, needle):
    """Issue 14.6 over HTTP: the proxy answers 400 for a lynx_mode outside allowed_modes (int4 here); remote-prefill
    params a client sends straight to D without P's signature are refused (the prompt is computed on D, the
    response says why) and counted in D's Prometheus metrics."""
    import urllib.error

    from lynx_connector.lab.models import model_dir
    from lynx_connector.metadata import RemotePrefill, mint_ticket

    model = str(model_dir())
    with pytest.raises(urllib.error.HTTPError) as exc:
        post(deployment.url + "/v1/completions", {"model": model, "prompt": needle.token_ids, "max_tokens": 2,
                                                  "kv_transfer_params": {"lynx_mode": "int4"}})
    body = json.loads(exc.value.read())
    assert exc.value.code == 400 and "allowed_modes" in body["error"]["message"], body
    tid, token = mint_ticket()
    forged = RemotePrefill(engine_id="evil", request_id="x", host="127.0.0.1", ports=(1,),
                           num_tokens=len(needle.token_ids), mode="full", transfer_id=tid, token=token).to_params()
    out = post(deployment.decode.url + "/v1/completions", {"model": model, "prompt": needle.token_ids,
                                                           "max_tokens": 12, "temperature": 0,
                                                           "kv_transfer_params": forged})
    assert out["kv_transfer_params"]["lynx_error"]["reason"] == "unsigned", out.get("kv_transfer_params")
    assert needle.answer in out["choices"][0]["text"], out  # served, from D's own prefill
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(deployment.decode.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        if re.search(r'vllm:lynx_refused_params_total\{[^}]*reason="unsigned"[^}]*\} [1-9]', metrics):
            break
        assert time.monotonic() < deadline, [ln for ln in metrics.splitlines() if "lynx" in ln]
        time.sleep(1)
    # and the deployment keeps serving
    ok = post(deployment.url + "/v1/completions", {"model": model, "prompt": needle.token_ids, "max_tokens": 12,
                                                   "temperature": 0})
    assert needle.answer in ok["choices"][0]["text"], ok
