"""The proxy's pipelined flow (lynx_connector/proxy_flow.py) against fake prefill and decode servers on 127.0.0.1:
P and D get the request at once with the same proxy-minted, signed ticket; the first request to a P and a
fanned-out one go the sequential way; P's refusal is the client's answer (D's call cancelled); P failing
otherwise leaves the answer to D. The real engines: tests/integration/test_pipelined_engines.py."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import pytest
from aiohttp import web

from lynx_connector.signing import ParamsSigner
from tests.test_proxy import P_PARAMS, Fake, run_scenario

KEY = bytes(range(32))


class TimedFake(Fake):
    """A fake that answers after ``delay`` s, records when each request arrived and whether it was cancelled;
    P's answers can be a refusal (``lynx_error``) or an HTTP error after the first request."""

    def __init__(self, role: str, delay: float = 0.0, refuse: bool = False, fail_after_first: bool = False):
        super().__init__(role, {**P_PARAMS, "lynx_mode": "full", "lynx_ports": [5600]})
        self.delay, self.refuse, self.fail_after_first = delay, refuse, fail_after_first
        self.arrived: list[float] = []
        self.answered: list[float] = []
        self.cancelled = 0

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.arrived.append(time.monotonic())
        first = not self.received
        try:
            if not first:
                await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.role == "prefill" and not first:
            if self.fail_after_first:
                self.status = 500
            elif self.refuse:
                self.kv_params = {"lynx_error": {"message": "lynx_mode 'int3' is not allowed", "code": 400,
                                                 "type": "BadRequestError"}}
        out = await super().generate(request)
        self.answered.append(time.monotonic())
        return out


def _post(session, url: str, body: dict[str, Any]):
    return session.post(url + "/v1/completions", json=body)


BODY = {"model": "m", "prompt": "hi", "max_tokens": 4}


def _with_key(monkeypatch) -> None:
    monkeypatch.setenv("LYNX_SIDE_CHANNEL_KEY", KEY.hex())
    monkeypatch.delenv("LYNX_SIDE_CHANNEL_KEY_FILE", raising=False)


def test_p_and_d_get_the_request_at_once_with_one_signed_ticket(monkeypatch) -> None:
    _with_key(monkeypatch)
    p, d = TimedFake("prefill", delay=0.4), TimedFake("decode")

    async def scenario(session, url):
        for _ in range(2):
            async with _post(session, url, BODY) as resp:
                assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "Hello!"
        async with session.get(url + "/lynx/stats") as resp:
            stats = await resp.json()
        assert stats["flows"] == {"pipelined": 1, "sequential": 1, "decode_only": 0, "fallback": 0} and stats["pipelined_on"]

    run_scenario([p], [d], scenario, flow="pipelined")
    # the first request taught the proxy P's side channel (sequential: D got P's own params)
    assert d.received[0]["kv_transfer_params"]["remote_request_id"] == "cmpl-1"
    p_params, d_params = p.received[1]["kv_transfer_params"], d.received[1]["kv_transfer_params"]
    assert p_params["lynx_flow"] == d_params["lynx_flow"] == "concurrent"
    assert p_params["lynx_transfer_id"] == d_params["lynx_transfer_id"] != p_params["lynx_token"]
    assert len(p_params["lynx_transfer_id"]) == 32 and p_params["lynx_token"] == d_params["lynx_token"]
    signer = ParamsSigner(KEY, 60)
    signer.verify(p_params)
    signer.verify(d_params)  # D accepts them as it accepts P's
    assert d_params["remote_host"] == "127.0.0.1" and d_params["lynx_ports"] == [5600]
    assert d_params["remote_num_tokens"] == 0 and d_params["lynx_mode"] == "full"  # P's default mode
    assert d.arrived[1] < p.answered[1]  # D had the request while P was still working on it
    assert p.received[1]["max_tokens"] == 1 and p.received[1]["stream"] is False


def test_p_refusal_is_the_answer_and_cancels_d(monkeypatch) -> None:
    _with_key(monkeypatch)
    p, d = TimedFake("prefill", delay=0.1, refuse=True), TimedFake("decode", delay=0.0)

    async def scenario(session, url):
        async with _post(session, url, BODY) as resp:
            assert resp.status == 200
        for stream in (False, True):  # D answers first (it computed the prompt itself); P's 400 wins
            async with _post(session, url, {**BODY, "stream": stream}) as resp:
                assert resp.status == 400, await resp.text()
                assert "int3" in (await resp.json())["error"]["message"]

    run_scenario([p], [d], scenario, flow="pipelined")


def test_p_refusal_before_d_answers_cancels_d(monkeypatch) -> None:
    _with_key(monkeypatch)
    p, d = TimedFake("prefill", delay=0.0, refuse=True), TimedFake("decode", delay=5.0)

    async def scenario(session, url):
        async with _post(session, url, BODY) as resp:
            assert resp.status == 200
        t0 = time.monotonic()
        async with _post(session, url, BODY) as resp:
            assert resp.status == 400
        assert time.monotonic() - t0 < 3.0  # not D's 5 s: its call was dropped

    run_scenario([p], [d], scenario, flow="pipelined")


def test_p_failing_leaves_the_answer_to_d(monkeypatch) -> None:
    _with_key(monkeypatch)
    p, d = TimedFake("prefill", delay=0.0, fail_after_first=True), TimedFake("decode", delay=0.2)

    async def scenario(session, url):
        for _ in range(2):
            async with _post(session, url, BODY) as resp:
                assert resp.status == 200  # the second: P answered 500, D (its failure policy) answered

    run_scenario([p], [d], scenario, flow="pipelined")
    assert d.received[1]["kv_transfer_params"]["lynx_flow"] == "concurrent"


def test_p_side_channel_is_learned_from_every_answer_and_forgotten_when_p_fails(monkeypatch) -> None:
    """A P restarted at the same URL listens on new side-channel ports (side_channel_port 0): its pipelined answers
    name them, and the proxy uses them from then on (it kept the first ports it learned, for good). A P that fails
    is forgotten: the next request to it goes the sequential way and learns its side channel afresh."""
    _with_key(monkeypatch)
    p, d = TimedFake("prefill"), TimedFake("decode")
    flows = []

    async def one(session, url) -> None:
        async with _post(session, url, BODY) as resp:
            assert resp.status == 200
        async with session.get(url + "/lynx/stats") as resp:
            flows.append(dict((await resp.json())["flows"]))

    async def scenario(session, url):
        await one(session, url)  # sequential: learns [5600]
        await one(session, url)
        p.kv_params = {**p.kv_params, "remote_port": 5700, "lynx_ports": [5700]}  # P restarted
        await one(session, url)  # still sent to [5600]; P's answer names [5700]
        await one(session, url)
        p.status = 500  # P fails: forgotten
        await one(session, url)
        p.status = 200
        await one(session, url)  # sequential again
        p.kv_params = {**p.kv_params, "remote_port": 5800, "lynx_ports": [5800]}  # P restarted again ...
        d.status = 500  # ... and D fails its pull from the dead ports: P's answer still teaches the proxy
        async with _post(session, url, BODY) as resp:
            assert resp.status == 502
        d.status = 200
        await one(session, url)

    run_scenario([p], [d], scenario, flow="pipelined")
    ports = [r["kv_transfer_params"].get("lynx_ports") for r in d.received]
    assert ports[:4] == [[5600], [5600], [5600], [5700]] and ports[-1] == [5800]
    assert [f["sequential"] for f in flows] == [1, 1, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("extra, key", [({"n": 2}, True), ({"n": 2.0}, True), ({"n": "3"}, True),
                                        ({"best_of": 2}, True), ({}, False)])
def test_sequential_when_the_pipelined_flow_cannot_apply(monkeypatch, extra, key) -> None:
    if key:
        _with_key(monkeypatch)
    else:
        monkeypatch.delenv("LYNX_SIDE_CHANNEL_KEY", raising=False)
        monkeypatch.delenv("LYNX_SIDE_CHANNEL_KEY_FILE", raising=False)
    p, d = TimedFake("prefill"), TimedFake("decode")

    async def scenario(session, url):
        for _ in range(2):
            async with _post(session, url, {**BODY, **extra}) as resp:
                assert resp.status == 200
        async with session.get(url + "/lynx/stats") as resp:
            stats = await resp.json()
        assert stats["flows"]["pipelined"] == 0 and stats["pipelined_on"] is key

    run_scenario([p], [d], scenario, flow="pipelined")
    assert all("lynx_flow" not in body["kv_transfer_params"] for body in d.received)


def test_flow_sequential_never_pipelines(monkeypatch) -> None:
    _with_key(monkeypatch)
    p, d = TimedFake("prefill"), TimedFake("decode")

    async def scenario(session, url):
        for _ in range(3):
            async with _post(session, url, BODY) as resp:
                assert resp.status == 200
        async with session.get(url + "/lynx/stats") as resp:
            assert (await resp.json())["pipelined_on"] is False

    run_scenario([p], [d], scenario, flow="sequential")
    assert all("lynx_flow" not in json.dumps(body) for body in p.received + d.received)


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_cancels_p_and_d_and_the_next_request_reaches_both(monkeypatch, stream) -> None:
    """A client that leaves while P is still working: both calls are cancelled (P and D abort the request), and the
    next request reaches P and D again (a cancelled call leaves no connection or slot behind)."""
    _with_key(monkeypatch)
    p, d = TimedFake("prefill", delay=1.0), TimedFake("decode", delay=1.5)

    async def scenario(session, url):
        async with _post(session, url, BODY) as resp:  # the proxy learns P
            assert resp.status == 200
        for _ in range(2):
            try:
                await asyncio.wait_for(_post(session, url, {**BODY, "stream": stream}), 0.3)
            except TimeoutError:
                pass  # the client left
        await asyncio.sleep(0.2)
        async with _post(session, url, BODY) as resp:
            assert resp.status == 200, await resp.text()
        async with session.get(url + "/lynx/stats") as resp:
            stats = await resp.json()
        assert stats["flows"]["pipelined"] == 3, stats

    run_scenario([p], [d], scenario, flow="pipelined")
    assert len(p.arrived) == len(d.arrived) == 4
    assert p.cancelled == 2 and d.cancelled == 2


def test_a_mode_the_params_cannot_carry_is_refused_and_frees_p_slot(monkeypatch) -> None:
    """A client's ``lynx_mode`` longer than signed params carry: 400 for that request, and P's admission slot is
    given back (``--max-inflight 1``: the next requests would wait for it until the queue timeout)."""
    _with_key(monkeypatch)
    p, d = TimedFake("prefill"), TimedFake("decode")
    bad = {**BODY, "kv_transfer_params": {"lynx_mode": "x" * 5000}}

    async def scenario(session, url):
        async with _post(session, url, BODY) as resp:  # the proxy learns P
            assert resp.status == 200
        for _ in range(3):
            async with _post(session, url, bad) as resp:
                assert resp.status == 400, await resp.text()
                assert "kv_transfer_params refused" in (await resp.json())["error"]["message"]
        async with _post(session, url, BODY) as resp:
            assert resp.status == 200, await resp.text()
        async with session.get(url + "/lynx/stats") as resp:
            stats = await resp.json()
        assert stats["flows"]["pipelined"] == 4, stats

    run_scenario([p], [d], scenario, flow="pipelined", max_inflight=1, max_queued=1, queue_timeout_s=2.0)
    assert len(p.received) == len(d.received) == 2  # the refused ones reached neither server


class DiesAfterHeaders(TimedFake):
    """A D that sends its stream's headers for the second request and then drops the connection."""

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if not self.received:
            return await super().generate(request)
        self.received.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return resp


def test_d_that_fails_before_its_first_byte_is_a_clear_error(monkeypatch) -> None:
    """Pipelined stream: D answers 200 and dies before its first byte (the proxy waits on it before P's verdict
    opens the stream): the client gets the proxy's JSON 503 naming the decode server, not a bare 500."""
    _with_key(monkeypatch)
    p, d = TimedFake("prefill"), DiesAfterHeaders("decode")

    async def scenario(session, url):
        async with _post(session, url, BODY) as resp:
            assert resp.status == 200
        async with _post(session, url, {**BODY, "stream": True}) as resp:
            assert resp.status == 503, await resp.text()
            assert "decode server unavailable" in (await resp.json())["error"]["message"]

    run_scenario([p], [d], scenario, flow="pipelined")


def test_a_p_silent_after_d_answered_is_cancelled(monkeypatch) -> None:
    """D answered (it computed the prompt itself, P being queued past D's concurrent_wait_s) and P has still not
    answered VERDICT_WAIT_S later: D's answer goes out and the call to P is cancelled, so P aborts the request
    and the proxy's P slot is free at once (before, P prefilled and staged it for nobody, holding the slot until
    it answered: review)."""
    from lynx_connector import proxy_flow

    _with_key(monkeypatch)
    monkeypatch.setattr(proxy_flow, "VERDICT_WAIT_S", 0.3)
    p, d = TimedFake("prefill", delay=30.0), TimedFake("decode")

    async def scenario(session, url):
        async with _post(session, url, BODY) as resp:  # sequential: the proxy learns P (P's delay skipped)
            assert resp.status == 200
        async with _post(session, url, BODY) as resp:
            assert resp.status == 200, await resp.text()
        for _ in range(50):
            if p.cancelled:
                break
            await asyncio.sleep(0.05)
        async with session.get(url + "/lynx/stats") as resp:
            stats = await resp.json()
        assert p.cancelled == 1 and sum(stats["prefill"]["inflight"].values()) == 0, stats

    run_scenario([p], [d], scenario, flow="pipelined")


@pytest.mark.parametrize("flow", ["pipelined", "sequential"])
def test_a_request_for_prompt_logprobs_goes_to_d_alone(monkeypatch, flow) -> None:
    """vLLM computes the prompt on D for a request that asks for prompt logprobs (it skips external KV then):
    the proxy sends it to D alone, without kv_transfer_params, sparing P a prefill and staging nobody reads
    (review: lm-eval's loglikelihood requests are echo + logprobs)."""
    _with_key(monkeypatch)
    p, d = TimedFake("prefill"), TimedFake("decode")
    local = [({**BODY, "prompt_logprobs": 1}, "/v1/completions"),
             ({**BODY, "echo": True, "logprobs": 0, "max_tokens": 1}, "/v1/completions"),
             ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": True, "logprobs": True,
               "top_logprobs": 2}, "/v1/chat/completions"),
             ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": True},  # top_logprobs: 0
              "/v1/chat/completions")]

    async def scenario(session, url):
        for body, path in [(BODY, "/v1/completions")] + local + [({**BODY, "echo": True}, "/v1/completions")]:
            async with session.post(url + path, json={**body, "kv_transfer_params": {"lynx_mode": "full"}}) as resp:
                assert resp.status == 200, await resp.text()
        async with session.get(url + "/lynx/stats") as resp:
            stats = await resp.json()
        assert stats["flows"]["decode_only"] == 4, stats

    run_scenario([p], [d], scenario, flow=flow)
    assert len(p.received) == 2 and len(d.received) == 6  # the first and the last (echo without logprobs) via P
    alone = d.received[1:5]
    assert all("kv_transfer_params" not in b for b in alone), alone


class SkewedPrefill(TimedFake):
    """A P whose clock is ``ahead_s`` ahead of the proxy's: it verifies the proxy's tickets as P's admission does
    (ParamsSigner.verify at its own time) and refuses them in P's own error shape (prefill_admission.bad_request);
    its HTTP Date header tells the same time."""

    def __init__(self, ahead_s: float, key: bytes = KEY):
        super().__init__("prefill")
        self.ahead_s, self.signer = ahead_s, ParamsSigner(key, 300.0)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        from email.utils import formatdate

        from lynx_connector.prefill_admission import bad_request
        from lynx_connector.signing import ParamsRefused

        params = (await request.json()).get("kv_transfer_params") or {}
        self.kv_params = {**P_PARAMS, "lynx_mode": "full", "lynx_ports": [5600]}
        if params.get("lynx_flow") == "concurrent":
            try:
                self.signer.verify(params, at=time.time() + self.ahead_s)
            except ParamsRefused as exc:
                self.kv_params = {"lynx_error": bad_request(f"concurrent-flow params refused ({exc.reason}): {exc}",
                                                            "kv_transfer_params", exc.reason)}
        out = await super().generate(request)
        out.headers["Date"] = formatdate(time.time() + self.ahead_s, usegmt=True)
        return out


@pytest.mark.parametrize("ahead_s,key,reason", [(1000.0, KEY, "expired"), (0.0, bytes(32), "bad_signature")],
                         ids=["clock_behind", "other_key"])
def test_p_refusing_the_proxys_own_ticket_sends_the_request_the_sequential_way(monkeypatch, caplog, ahead_s, key,
                                                                               reason) -> None:
    """A proxy clock behind P's by over --params-ttl, or a proxy with another key: P refuses every ticket the
    proxy signs. That is the proxy's fault, not the client's: the request goes the sequential way (P signs its own
    params) and succeeds, the warning says what to fix, and the next requests to that P go the sequential way at
    once until SUSPEND_S has passed (before: every pipelined request was answered 400 ``expired``)."""
    import logging

    from lynx_connector import proxy_flow

    _with_key(monkeypatch)
    monkeypatch.setattr(proxy_flow, "SUSPEND_S", 1.0)
    p, d = SkewedPrefill(ahead_s, key), TimedFake("decode")

    async def scenario(session, url):
        for _ in range(3):  # learn P (sequential); refused ticket -> sequential; suspended -> sequential
            async with _post(session, url, BODY) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["choices"][0]["text"] == "Hello!"
        await asyncio.sleep(1.2)  # the suspension is over: the proxy tries its ticket again (refused again)
        async with _post(session, url, BODY) as resp:
            assert resp.status == 200, await resp.text()
        async with session.get(url + "/lynx/stats") as resp:
            stats = await resp.json()
        assert stats["flows"] == {"pipelined": 2, "sequential": 2, "decode_only": 0, "fallback": 2}, stats
        assert sum(stats["prefill"]["inflight"].values()) == 0, stats

    with caplog.at_level(logging.INFO, logger="lynx_connector.proxy_flow"):
        run_scenario([p], [d], scenario, flow="pipelined")
    tickets = [b["kv_transfer_params"].get("lynx_flow") for b in p.received]
    assert tickets == [None, "concurrent", None, None, "concurrent", None], tickets
    # D got each request once with P's own params, plus the two pipelined calls the proxy dropped
    d_flows = [b["kv_transfer_params"].get("lynx_flow") for b in d.received]
    assert d_flows.count("concurrent") <= 2 and d_flows.count(None) == 4, d_flows
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
    assert len(warnings) == 2 and all(f"({reason}" in w for w in warnings), warnings
    if reason == "expired":
        # the Date header has whole seconds
        assert re.search(r"(999|1000|1001) s ahead of the proxy's", warnings[0]) and "NTP" in warnings[0], warnings[0]
    else:
        assert "LYNX_SIDE_CHANNEL_KEY_FILE" in warnings[0], warnings[0]


def test_a_client_fault_refusal_in_the_pipelined_flow_is_still_relayed(monkeypatch) -> None:
    """Only a refusal of the proxy's own ticket (P's ``lynx_reason``) sends a request the sequential way; P
    refusing what the client asked (a mode not allowed, a prompt too long) is the client's 400, as before."""
    _with_key(monkeypatch)
    p, d = TimedFake("prefill", refuse=True), TimedFake("decode")

    async def scenario(session, url):
        async with _post(session, url, BODY) as resp:
            assert resp.status == 200
        async with _post(session, url, BODY) as resp:
            assert resp.status == 400
        async with session.get(url + "/lynx/stats") as resp:
            assert (await resp.json())["flows"]["fallback"] == 0

    run_scenario([p], [d], scenario, flow="pipelined")
    assert len(p.received) == 2
