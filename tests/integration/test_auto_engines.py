"""``lynx:auto`` (issue 16.3) on real `lynx serve` P and D behind `lynx proxy`: the preset installs the
speculative scheduler on both, so on a slow link P picks speculative for a greedy request and full for a
sampled one (its first token could not be released on the anchor); both are served and report the choice."""

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
    with Deployment(model, tmp_path_factory.mktemp("auto"), kv_transfer_config=cfg, max_model_len=4096) as dep:
        yield dep


@pytest.fixture(scope="module")
def needle(deployment):
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_needle_prompt
    from lynx_connector.lab.models import model_dir

    return build_needle_prompt(AutoTokenizer.from_pretrained(str(model_dir())), 1200, depth=0.5, seed=7)


def test_lynx_auto_speculates_greedy_requests_and_serves_sampled_ones_full(deployment, needle):
    from lynx_connector.lab.models import model_dir

    body = {"model": str(model_dir()), "prompt": needle.token_ids, "max_tokens": 12}
    greedy = post(deployment.url + "/v1/completions", {**body, "temperature": 0})  # the instance's mode: auto
    assert needle.answer in greedy["choices"][0]["text"], greedy
    assert greedy["kv_transfer_params"]["lynx_auto"] == {"mode": "speculative", "reason": "slow_link"}
    sampled = post(deployment.url + "/v1/completions", {**body, "temperature": 0.7, "seed": 3,
                                                        "kv_transfer_params": {"lynx_mode": "auto"}})
    assert sampled["choices"][0]["text"], sampled
    assert sampled["kv_transfer_params"]["lynx_auto"] == {"mode": "full", "reason": "slow_link_no_speculation"}
    p_log = deployment.prefill.log_path.read_text()
    assert re.search(r"auto chose speculative \(slow_link\)", p_log)
    assert re.search(r"auto chose full \(slow_link_no_speculation\)", p_log)
    assert "speculation" in deployment.decode.log_path.read_text()  # D speculated on the greedy one
