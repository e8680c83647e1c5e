"""The proxy's answer to several prompts in one completion request (lynx_connector/proxy_batch.py): prompts
counted as vLLM counts them, answers merged as vLLM answers, a list taking turns in the admission queue."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from lynx_connector.proxy_batch import prompt_list
from tests.test_proxy import Fake, check_proxy_error, run_scenario


class ListFake(Fake):
    """D answering one prompt as vLLM would (id from the request id, per-request metrics, cached tokens); it
    records how many requests it serves at once, and answers ``bad`` bodies with text that is not JSON."""

    def __init__(self, role: str, delay: float = 0.0, bad: bool = False) -> None:
        super().__init__(role)
        self.delay, self.bad = delay, bad
        self.now = self.most = 0

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.role == "prefill":
            return await super().generate(request)
        body = await request.json()
        self.received.append(body)
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.now -= 1
        if self.bad:
            return web.Response(text="<html>oops</html>", content_type="text/html")
        text = str(body.get("prompt", body.get("prompt_embeds")))
        return web.json_response({
            "id": f"cmpl-{request.headers['X-Request-Id']}", "object": "text_completion", "metrics": {"ttft": 0.1},
            "choices": [{"index": 0, "text": text}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3,
                      "prompt_tokens_details": {"cached_tokens": 16}}})


def test_embeddings_and_prompts_are_split_in_vllms_order_and_merged_as_vllm_answers() -> None:
    """vLLM runs ``prompt_embeds`` entries first, then ``prompt`` entries (each its own request): such a body
    went to P and D whole, one transfer named for several prompts. The merged answer has the request's own id, no
    per-request metrics, and the prompts' usage summed (cached tokens too)."""
    p, d = Fake("prefill"), ListFake("decode")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        body = {"prompt_embeds": ["E1", "E2"], "prompt": "z", "max_tokens": 1}
        async with s.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "b-2"}) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        assert [c["text"] for c in out["choices"]] == ["E1", "E2", "z"]
        assert out["id"] == "cmpl-b-2" and "metrics" not in out
        assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9,
                                "prompt_tokens_details": {"cached_tokens": 48}}

    run_scenario([p], [d], scenario, flow="sequential")
    # an empty list is no prompt, as vLLM counts it: such a body is one prompt, sent whole
    assert prompt_list({"prompt": "hello", "prompt_embeds": []}) is None
    assert prompt_list({"prompt": [], "prompt_embeds": ["E1", "E2"]}) == [{"prompt_embeds": "E1"},
                                                                          {"prompt_embeds": "E2"}]
    sent = sorted((sorted(k for k in b if k.startswith("prompt")), b.get("prompt", b.get("prompt_embeds")))
                  for b in p.received)
    assert sent == [(["prompt"], "z"), (["prompt_embeds"], "E1"), (["prompt_embeds"], "E2")]


def test_a_long_list_takes_turns_instead_of_filling_the_queue() -> None:
    """Six prompts with --max-inflight 1 --max-queued 1: all six prompts used to ask for a slot at once, so the
    list was refused 503 on an idle proxy; at most --max-inflight of them are in flight now. A list longer than
    vLLM's limit (1024) is refused with 400."""
    p, d = Fake("prefill"), ListFake("decode", delay=0.05)

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": [f"p{i}" for i in range(6)]}) as r:
            assert r.status == 200, await r.text()
            assert [c["index"] for c in (await r.json())["choices"]] == list(range(6))
        async with s.post(url + "/v1/completions", json={"prompt": ["x"] * 1025}) as r:
            assert r.status == 400
            check_proxy_error(400, await r.json(), r.headers["X-Request-Id"], "at most 1024 prompts")
        async with s.get(url + "/lynx/stats") as r:
            stats = await r.json()
        assert all(v == 0 for role in ("prefill", "decode") for v in stats[role]["inflight"].values())

    run_scenario([p], [d], scenario, flow="sequential", max_inflight=1, max_queued=1)
    assert d.most == 1 and len(d.received) == 6


def test_a_prompt_answered_with_a_body_that_is_not_json_is_a_502() -> None:
    p, d = Fake("prefill"), ListFake("decode", bad=True)

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": ["a", "b"]}) as r:
            assert r.status == 502
            check_proxy_error(502, await r.json(), r.headers["X-Request-Id"], "decode")

    run_scenario([p], [d], scenario, flow="sequential")


