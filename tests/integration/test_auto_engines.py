"""``lynx:auto`` (issue 16.3) on real `lynx serve` P and D behind `lynx proxy`: the preset installs the
speculative scheduler on both, so on a slow link P picks speculative for a greedy request and full for a
sampled one (its first token could not be released on the anchor); both are served and report the choice.

Through the sequential flow D serves the mode P chose. Through the pipelined flow (the proxy's default) D hears
of the request before P has chosen and serves a Lynx choice, full or speculative (the same planes), as the Lynx
mode it can serve, speculative here: docs/PROTOCOL.md section 7. Both flows run against the same P and D."""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.test_servers import post

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, model):
    from lynx_connector.lab.launch import Deployment

    cfg = json.dumps({"kv_connector": "lynx:auto",
                      "kv_connector_extra_config": {"link_gbps": 0.5, "lease_s": 60}})
    dep = Deployment(model, tmp_path_factory.mktemp("auto"), kv_transfer_config=cfg, max_model_len=4096)
    dep.sequential_url = dep.add_proxy("proxy-sequential", ["--flow", "sequential"]).url  # type: ignore[attr-defined]
    with dep:
        yield dep


@pytest.fixture(scope="module")
def needle(deployment):
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_needle_prompt
    from lynx_connector.lab.models import model_dir

    return build_needle_prompt(AutoTokenizer.from_pretrained(str(model_dir())), 1200, depth=0.5, seed=7)


def test_lynx_auto_chooses_per_request_and_each_flow_serves_the_choice(deployment, needle):
    from lynx_connector.lab.models import model_dir

    body = {"model": str(model_dir()), "prompt": needle.token_ids, "max_tokens": 12}
    sampled_body = {**body, "temperature": 0.7, "seed": 3, "kv_transfer_params": {"lynx_mode": "auto"}}
    # sequential flow: P's signed answer names its choice and D serves exactly that
    greedy = post(deployment.sequential_url + "/v1/completions", {**body, "temperature": 0})  # instance mode: auto
    assert needle.answer in greedy["choices"][0]["text"], greedy
    assert greedy["kv_transfer_params"]["lynx_auto"] == {"mode": "speculative", "reason": "slow_link"}
    sampled = post(deployment.sequential_url + "/v1/completions", sampled_body)
    assert sampled["choices"][0]["text"], sampled
    assert sampled["kv_transfer_params"]["lynx_auto"] == {"mode": "full", "reason": "slow_link_no_speculation"}
    # pipelined flow: P names its choice on the side channel; D serves a greedy Lynx one as speculative (it can);
    # a seeded sampled one as full (reproducible: speculation's draws would depend on when the residual lands)
    greedy = post(deployment.url + "/v1/completions", {**body, "temperature": 0})
    assert needle.answer in greedy["choices"][0]["text"], greedy
    assert greedy["kv_transfer_params"]["lynx_auto"] == {"mode": "speculative", "reason": "slow_link"}
    sampled = post(deployment.url + "/v1/completions", sampled_body)
    assert sampled["choices"][0]["text"], sampled
    assert sampled["kv_transfer_params"]["lynx_auto"] == {"mode": "full", "reason": "slow_link_no_speculation"}
    p_log = deployment.prefill.log_path.read_text()
    assert len(re.findall(r"auto chose speculative \(slow_link\)", p_log)) == 2
    assert len(re.findall(r"auto chose full \(slow_link_no_speculation\)", p_log)) == 2
    assert "speculation" in deployment.decode.log_path.read_text()  # D speculated on the greedy ones
