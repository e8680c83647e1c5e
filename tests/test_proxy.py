"""The P/D proxy against fake prefill and decode servers on 127.0.0.1 (no vLLM, no model)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from lynx_connector.proxy import SERVER_OPTIONS, ProxyConfig, build_prefill_request, create_app, normalize_url

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
            "remote_engine_id": "eng-p", "remote_request_id": "cmpl-1", "remote_host": "127.0.0.1",
            "remote_port": 5600, "lynx": {"anchor_nbytes": 123}}


class Fake:
    """A fake vLLM server recording what it receives."""

    def __init__(self, role: str, kv_params: dict[str, Any] | None = P_PARAMS, status: int = 200) -> None:
        self.role = role
        self.kv_params = kv_params
        self.status = status
        self.received: list[dict[str, Any]] = []
        self.request_ids: list[str | None] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, _r: web.Request) -> web.Response:
        return web.Response(status=self.status)

    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "owned_by": self.role}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id"))
        if self.status != 200:
            return web.Response(body=vllm_error(self.role, self.status), status=self.status,
                                content_type="application/json")
        chat = request.path.endswith("chat/completions")
        if self.role == "prefill":
            return web.json_response({"id": "p", "choices": [{"text": "x"}],
                                      "kv_transfer_params": self.kv_params})
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for tok in ("Hel", "lo", "!"):
                delta = {"delta": {"content": tok}} if chat else {"text": tok}
                await resp.write(f"data: {json.dumps({'choices': [delta]})}\n\n".encode())
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        choice = {"message": {"role": "assistant", "content": "Hello!"}} if chat else {"text": "Hello!"}
        return web.json_response({"id": "d", "choices": [choice]})


def vllm_error(role: str, status: int) -> bytes:
    """An error body as vLLM writes one (compact JSON, ``param`` set)."""
    return json.dumps({"error": {"message": f"{role} says no", "type": "BadRequestError", "param": "max_tokens",
                                 "code": status}}, separators=(",", ":")).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Scenario = Callable[[aiohttp.ClientSession, str], Awaitable[None]]


@pytest.fixture
def proxy_log() -> Iterator[list[str]]:
    """The proxy's log lines (its logger sits under vLLM's, which does not propagate to the root)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage() + ("\n" + self.format(record) if record.exc_info else ""))

    handler = Keep(level=logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("vllm.lynx_connector.proxy", "vllm.lynx_connector.proxy_upstream")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


def run_scenario(fakes_p: list[Fake | None], fakes_d: list[Fake | None], scenario: Scenario,
                 **cfg: Any) -> None:
    """Start the fakes (None = a port nobody listens on) and the proxy, then run ``scenario``."""

    async def main() -> None:
        servers: list[TestServer] = []

        async def url_of(fake: Fake | None) -> str:
            if fake is None:
                return f"http://127.0.0.1:{_free_port()}"
            server = TestServer(fake.app(), host="127.0.0.1")
            await server.start_server()
            servers.append(server)
            return str(server.make_url("")).rstrip("/")

        p_urls = [await url_of(f) for f in fakes_p]
        d_urls = [await url_of(f) for f in fakes_d]
        # the proxy runs as `lynx proxy` runs it (SERVER_OPTIONS: a client that disconnects cancels its handler)
        runner = web.AppRunner(create_app(ProxyConfig(prefill=p_urls, decode=d_urls, **cfg)), **SERVER_OPTIONS)
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                await scenario(session, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()
            for server in servers:
                await server.close()

    asyncio.run(main())


def test_prefill_request_shape() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 5}
    req = build_prefill_request(body, chat=True)
    assert req["max_tokens"] == 1 and req["max_completion_tokens"] == 1
    assert req["stream"] is False and "stream_options" not in req and "min_tokens" not in req
    assert req["kv_transfer_params"]["do_remote_decode"] is True
    assert req["kv_transfer_params"]["do_remote_prefill"] is False
    assert body["max_tokens"] == 50 and body["stream"] is True  # the original is untouched
    assert normalize_url("127.0.0.1:8100/") == "http://127.0.0.1:8100"


def test_prefill_request_carries_only_the_clients_transfer_mode() -> None:
    body = {"model": "m", "prompt": "hi", "kv_transfer_params": {
        "lynx_mode": "int8", "remote_host": "evil.example", "do_remote_decode": False}}
    params = build_prefill_request(body, chat=False)["kv_transfer_params"]
    assert params["lynx_mode"] == "int8"
    assert params["do_remote_decode"] is True and params["remote_host"] is None  # nothing else is taken


def test_completions_non_stream_forwards_params_verbatim() -> None:
    p, d = Fake("prefill"), Fake("decode")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        body = {"model": "m", "prompt": "hello", "max_tokens": 16, "temperature": 0}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == "Hello!"

    run_scenario([p], [d], scenario)
    assert p.received[0]["max_tokens"] == 1 and p.received[0]["stream"] is False
    assert p.received[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert d.received[0]["kv_transfer_params"] == P_PARAMS
    assert d.received[0]["max_tokens"] == 16 and d.received[0]["prompt"] == "hello"
    assert p.request_ids[0] is not None and p.request_ids[0] == d.request_ids[0]


def test_the_debug_log_of_p_answer_names_its_keys_not_its_secrets(proxy_log: list[str]) -> None:
    """P's kv_transfer_params carry the transfer token and their signature: the proxy's DEBUG line logged them
    whole; it names the keys only."""
    p = Fake("prefill", kv_params={**P_PARAMS, "lynx_token": "f" * 32, "lynx_sig": "a" * 64})

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}) as r:
            assert r.status == 200

    run_scenario([p], [Fake("decode")], scenario)
    line = next(x for x in proxy_log if "prefilled on" in x)
    assert "lynx_token" in line and "f" * 32 not in line and "a" * 64 not in line


def test_completions_stream() -> None:
    p, d = Fake("prefill"), Fake("decode")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        body = {"model": "m", "prompt": "hello", "max_tokens": 16, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            text = (await r.read()).decode()
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "Hello!"

    run_scenario([p], [d], scenario)
    assert p.received[0]["stream"] is False and d.received[0]["stream"] is True
    assert d.received[0]["kv_transfer_params"] == P_PARAMS


def test_chat_stream_and_non_stream() -> None:
    p, d = Fake("prefill"), Fake("decode")
    msgs = [{"role": "user", "content": "hi"}]

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/chat/completions", json={"model": "m", "messages": msgs}) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["message"]["content"] == "Hello!"
        async with s.post(url + "/v1/chat/completions",
                          json={"model": "m", "messages": msgs, "stream": True}) as r:
            text = (await r.read()).decode()
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]) == "Hello!"

    run_scenario([p], [d], scenario)
    assert all(r["max_completion_tokens"] == 1 and r["max_tokens"] == 1 for r in p.received)
    assert all(r["kv_transfer_params"] == P_PARAMS for r in d.received)
    assert d.received[0]["messages"] == msgs and "max_completion_tokens" not in d.received[0]


def test_round_robin() -> None:
    ps, ds = [Fake("prefill"), Fake("prefill")], [Fake("decode"), Fake("decode")]

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        for _ in range(4):
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200

    run_scenario(ps, ds, scenario)
    assert [len(f.received) for f in ps + ds] == [2, 2, 2, 2]


def check_proxy_error(status: int, payload: dict[str, Any], request_id: str, *words: str) -> str:
    """The proxy's own error: vLLM's shape, a generic message with the correlation id, no URL."""
    err = payload["error"]
    assert list(payload) == ["error"] and list(err) == ["message", "type", "param", "code"], payload
    assert err["code"] == status and err["param"] is None and err["type"], payload
    assert err["message"].endswith(f"(request id: {request_id})"), payload
    assert "127.0.0.1" not in err["message"] and "http" not in err["message"], payload
    for word in words:
        assert word in err["message"], payload
    return err["message"]


def _expect_error(status: int, *words: str, stream: bool = True) -> Scenario:
    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": stream},
                          headers={"X-Request-Id": "client-7"}) as r:
            assert r.status == status, await r.text()
            assert r.headers["X-Request-Id"] == "client-7"
            check_proxy_error(status, await r.json(), "client-7", *words)

    return scenario


def test_prefill_down() -> None:
    d = Fake("decode")
    run_scenario([None], [d], _expect_error(503, "prefill", "unavailable"))
    assert d.received == []


def test_decode_down() -> None:
    run_scenario([Fake("prefill")], [None], _expect_error(503, "decode", "unavailable"))


def test_prefill_without_kv_transfer_params() -> None:
    d = Fake("decode")
    run_scenario([Fake("prefill", kv_params=None)], [d], _expect_error(502, "prefill", "kv_transfer_params"))
    assert d.received == []


def test_upstream_5xx_is_a_generic_502_with_the_details_in_the_log(proxy_log: list[str]) -> None:
    run_scenario([Fake("prefill", status=500)], [Fake("decode")], _expect_error(502, "prefill"))
    run_scenario([Fake("prefill")], [Fake("decode", status=503)], _expect_error(502, "decode", stream=False))
    failed = [line for line in proxy_log if "failed" in line]
    assert len(failed) == 2 and "HTTP 500" in failed[0] and "prefill says no" in failed[0], proxy_log
    assert "request client-7" in failed[1] and "http://127.0.0.1:" in failed[1] and "HTTP 503" in failed[1]


@pytest.mark.parametrize("status", [400, 404, 422])
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_vllm_4xx_bodies_pass_through_byte_identical(side: str, status: int) -> None:
    p = Fake("prefill", status=status if side == "prefill" else 200)
    d = Fake("decode", status=status if side == "decode" else 200)

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        for stream in (False, True):
            async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": stream}) as r:
                assert r.status == status
                assert await r.read() == vllm_error(side, status)
                assert r.headers["Content-Type"].startswith("application/json")
                assert r.headers["X-Request-Id"].startswith("lynx-")

    run_scenario([p], [d], scenario)
    assert d.received == [] if side == "prefill" else len(d.received) == 2


def test_prefill_refusing_the_clients_lynx_params_is_relayed_as_vllms_400_and_d_is_not_called() -> None:
    """P's scheduler half refuses a lynx_mode the operator does not allow (issue 14.6): its response carries a
    lynx_error (vLLM's error fields) instead of remote-prefill params; the proxy answers the client with it, in
    vLLM's error shape and status, and never calls D."""
    d = Fake("decode")
    err = {"message": "lynx_mode 'int4' is not allowed on this deployment (allowed_modes: full, speculative, bf16)",
           "type": "BadRequestError", "param": "kv_transfer_params.lynx_mode", "code": 400}

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 400
            assert await r.json() == {"error": err}

    run_scenario([Fake("prefill", kv_params={"lynx_error": err})], [d], scenario)
    assert d.received == []


def test_bad_json_body() -> None:
    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400
            check_proxy_error(400, await r.json(), r.headers["X-Request-Id"], "JSON")
        async with s.post(url + "/v1/completions", json=[1, 2]) as r:
            assert r.status == 400
        async with s.post(url + "/v1/completions", data=b"[" * 200_000) as r:  # under --max-body-bytes
            assert r.status == 400
            check_proxy_error(400, await r.json(), r.headers["X-Request-Id"], "nested too deeply")
        # valid JSON nested deeper than the proxy's copies of the body for P and D can go: refused, and P is not
        # called (a plain-text 500 from the stack overflowing in the copy, P called and D not in the pipelined flow)
        deep = {"prompt": "x", "extra": json.loads("[" * 600 + "]" * 600)}
        async with s.post(url + "/v1/completions", json=deep) as r:
            assert r.status == 400
            check_proxy_error(400, await r.json(), r.headers["X-Request-Id"], "nested too deeply", "128")
        ok = {"prompt": "x", "extra": json.loads("[" * 120 + "]" * 120)}
        async with s.post(url + "/v1/completions", json=ok) as r:
            assert r.status == 200

    p = Fake("prefill")
    run_scenario([p], [Fake("decode")], scenario)
    assert len(p.received) == 1


def test_an_unexpected_error_fails_that_request_in_vllms_shape_and_the_proxy_goes_on(monkeypatch) -> None:
    from lynx_connector import proxy as proxy_module

    real = proxy_module._serve
    calls = [0]

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a bug")
        return await real(*args, **kwargs)

    monkeypatch.setattr(proxy_module, "_serve", flaky)

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 500
            check_proxy_error(500, await r.json(), r.headers["X-Request-Id"], "internal error")
        async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200

    run_scenario([Fake("prefill")], [Fake("decode")], scenario)


def test_health_and_models() -> None:
    async def healthy(s: aiohttp.ClientSession, url: str) -> None:
        async with s.get(url + "/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with s.get(url + "/v1/models") as r:
            assert (await r.json())["data"][0]["owned_by"] == "decode"

    run_scenario([Fake("prefill")], [Fake("decode")], healthy)

    async def unhealthy(s: aiohttp.ClientSession, url: str) -> None:
        async with s.get(url + "/health") as r:
            body = await r.json()
            assert r.status == 503 and "decode" in body["message"], body
            assert list(body["prefill"].values()) == ["ok"]

    run_scenario([Fake("prefill")], [None], unhealthy, health_timeout_s=2.0)

    class Silent(Fake):
        async def health(self, _r: web.Request) -> web.Response:
            await asyncio.sleep(5)
            return web.Response()

        models = health

    async def failover(s: aiohttp.ClientSession, url: str) -> None:
        """/v1/models passes over a decode server that is down or silent; /health names a timeout's kind."""
        for _ in range(4):
            async with s.get(url + "/v1/models") as r:
                assert r.status == 200
        async with s.get(url + "/health") as r:
            assert "unreachable: TimeoutError" in (await r.json())["message"]

    run_scenario([Fake("prefill")], [Fake("decode"), None, Silent("decode")], failover, health_timeout_s=0.5)


def test_timeout_names_the_side() -> None:
    class Slow(Fake):
        async def generate(self, request: web.Request) -> web.StreamResponse:
            await asyncio.sleep(2)
            return await super().generate(request)

    run_scenario([Slow("prefill")], [Fake("decode")], _expect_error(504, "prefill", "timed out"),
                 read_timeout_s=0.3)


class SlowDecode(Fake):
    """A decode server that holds every request until released, counting how many it holds at once."""

    def __init__(self) -> None:
        super().__init__("decode")
        self.gate = asyncio.Event()
        self.now = 0
        self.peak = 0

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await self.gate.wait()
            return await super().generate(request)
        finally:
            self.now -= 1


def test_admission_limits_inflight_per_server_and_queues_the_rest() -> None:
    """10 concurrent requests, --max-inflight 3 on one D: never more than 3 at D, all 10 answered in order."""
    d = SlowDecode()
    p = Fake("prefill")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async def one() -> int:
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                return r.status

        tasks = [asyncio.create_task(one()) for _ in range(10)]
        await asyncio.sleep(0.3)
        async with s.get(url + "/lynx/stats") as r:
            stats = await r.json()
        assert stats["decode"]["inflight"] == {next(iter(stats["decode"]["inflight"])): 3}
        assert stats["decode"]["queued"] == 7
        assert len(p.received) == 3  # P prefills only for requests holding a D slot
        d.gate.set()
        assert await asyncio.gather(*tasks) == [200] * 10
        async with s.get(url + "/lynx/stats") as r:
            stats = await r.json()
        assert stats["decode"]["queued"] == 0 and set(stats["decode"]["inflight"].values()) == {0}
        assert stats["prefill"]["admitted"] == 10 and stats["decode"]["admitted"] == 10

    run_scenario([p], [d], scenario, max_inflight=3)
    assert d.peak == 3 and len(d.received) == 10


def test_more_admitted_calls_than_aiohttps_default_pool_all_reach_d_and_health_stays_ok() -> None:
    """120 requests admitted at once on one D (--max-inflight 120): each has its connection to D, and /health
    answers meanwhile. aiohttp's default pool (100 connections in all) kept 20 waiting until --connect-timeout
    (504 with P and D idle) and /health, queued behind them, reported D unreachable."""
    d = SlowDecode()
    n = 120

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async def one() -> int:
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                return r.status

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        deadline = asyncio.get_running_loop().time() + 20
        while d.now < n and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert d.now == n
        async with s.get(url + "/health") as r:
            assert r.status == 200, await r.text()
        d.gate.set()
        assert await asyncio.gather(*tasks) == [200] * n

    run_scenario([Fake("prefill")], [d], scenario, max_inflight=n, connect_timeout_s=1.0)
    assert d.peak == n


def test_admission_refuses_at_once_when_the_queue_is_full_or_the_wait_too_long(proxy_log: list[str]) -> None:
    d = SlowDecode()

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async def one() -> tuple[int, str]:
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                if r.status == 200:
                    return 200, ""
                return r.status, check_proxy_error(r.status, await r.json(), r.headers["X-Request-Id"])

        tasks = [asyncio.create_task(one()) for _ in range(4)]  # 1 in flight, 2 queued, 1 refused
        await asyncio.sleep(0.2)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        status, message = await one()  # the queue is full: refused at once
        assert status == 503 and "overloaded" in message and loop.time() - t0 < 0.5
        # the gate stays shut: of the other three, two time out in the queue and one was refused at once
        results = await asyncio.gather(*tasks[1:])
        assert [st for st, _ in results].count(503) == 3
        async with s.get(url + "/lynx/stats") as r:
            stats = (await r.json())["decode"]
        assert stats["rejected_queue_full"] == 2 and stats["rejected_timeout"] == 2, stats
        d.gate.set()
        assert (await tasks[0])[0] == 200
        assert (await one())[0] == 200  # and the proxy serves again

    run_scenario([Fake("prefill")], [d], scenario, max_inflight=1, max_queued=2, queue_timeout_s=1.0)
    refusals = [line for line in proxy_log if "refused" in line]
    assert sum("--max-queued 2" in line for line in refusals) == 2, proxy_log  # the limit is named in the log
    assert sum("--queue-timeout" in line for line in refusals) == 2, proxy_log


def test_admission_picks_the_least_loaded_server() -> None:
    busy, idle = SlowDecode(), Fake("decode")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        hold = asyncio.create_task(s.post(url + "/v1/completions", json={"prompt": "x"}))
        await asyncio.sleep(0.2)
        for _ in range(3):  # busy holds one request: the next ones all go to the idle server
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
        busy.gate.set()
        (await hold).release()

    run_scenario([Fake("prefill")], [busy, idle], scenario)
    assert len(busy.received) == 1 and len(idle.received) == 3


class Hanging(Fake):
    """Answers nothing (after one SSE event when streaming) until the proxy closes the connection, and records
    that it noticed: the handler is cancelled, as vLLM's is (which then aborts the request)."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        try:
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            self.started.set()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


async def _idle(s: aiohttp.ClientSession, url: str) -> None:
    async with s.get(url + "/lynx/stats") as r:
        stats = await r.json()
    assert set(stats["decode"]["inflight"].values()) == {0} and set(stats["prefill"]["inflight"].values()) == {0}


def _disconnect_logged(proxy_log: list[str], phase: str) -> None:
    gone = [line for line in proxy_log if "client disconnected" in line]
    assert len(gone) == 1 and phase in gone[0], proxy_log
    assert not any("Traceback" in line or "failed" in line for line in proxy_log), proxy_log


def test_client_disconnect_mid_stream_cancels_the_decode_call(proxy_log: list[str]) -> None:
    d = Hanging("decode")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        r = await s.post(url + "/v1/completions", json={"prompt": "x", "stream": True})
        assert r.status == 200 and (await r.content.readany()).startswith(b"data: ")
        r.close()  # the client goes away mid-generation
        await asyncio.wait_for(d.cancelled.wait(), 5)
        await asyncio.sleep(0.1)
        await _idle(s, url)

    run_scenario([Fake("prefill")], [d], scenario)
    _disconnect_logged(proxy_log, "decode stream")


def test_client_disconnect_while_waiting_for_d_or_p_cancels_that_call(proxy_log: list[str]) -> None:
    for side in ("decode", "prefill"):
        p = Hanging("prefill") if side == "prefill" else Fake("prefill")
        d = Hanging("decode") if side == "decode" else Fake("decode")
        hanging = p if side == "prefill" else d
        assert isinstance(hanging, Hanging)

        async def scenario(s: aiohttp.ClientSession, url: str, hanging: Hanging = hanging) -> None:
            with pytest.raises(TimeoutError):
                await s.post(url + "/v1/completions", json={"prompt": "x"}, timeout=aiohttp.ClientTimeout(total=0.5))
            await asyncio.wait_for(hanging.cancelled.wait(), 5)
            await asyncio.sleep(0.1)
            await _idle(s, url)

        run_scenario([p], [d], scenario)
        _disconnect_logged(proxy_log, side)
        assert len(d.received) == (1 if side == "decode" else 0)
        proxy_log.clear()


class FailsMidStream(Fake):
    """A D that sends one event, then dies in the middle of the next (``dies``) or goes silent."""

    def __init__(self, dies: bool) -> None:
        super().__init__("decode")
        self.dies = dies

    async def generate(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n' + (b'data: {"choi' if self.dies else b""))
        if self.dies:
            assert request.transport is not None
            request.transport.abort()  # D dies mid-event
        else:
            await asyncio.sleep(5)
        return resp


@pytest.mark.parametrize("dies", [True, False], ids=["dies", "silent"])
def test_decode_failing_mid_stream_ends_with_vllms_error_event(proxy_log: list[str], dies: bool) -> None:
    """D dying mid-stream is a 502 event; D silent for --read-timeout a 504, as before the stream began
    (OPERATIONS; it was called a 502 'failed')."""
    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            assert r.status == 200
            rid = r.headers["X-Request-Id"]
            events = [e for e in (await r.read()).decode().split("\n\n") if e]
        assert events[0] == 'data: {"choices": [{"text": "a"}]}' and events[-1] == "data: [DONE]"
        if dies:
            assert events[1] == 'data: {"choi'
            check_proxy_error(502, json.loads(events[-2][6:]), rid, "decode", "failed mid-stream")
        else:
            check_proxy_error(504, json.loads(events[-2][6:]), rid, "decode", "timed out mid-stream")

    run_scenario([Fake("prefill")], [FailsMidStream(dies)], scenario, read_timeout_s=0.5)
    assert any("failed mid-stream" in line and "http://127.0.0.1:" in line for line in proxy_log), proxy_log


def test_request_deadline(proxy_log: list[str]) -> None:
    d = Hanging("decode")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 504
            check_proxy_error(504, await r.json(), r.headers["X-Request-Id"], "0.5s")
        await asyncio.wait_for(d.cancelled.wait(), 5)  # D's call was closed: it aborts the request
        d.cancelled.clear()
        async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            assert r.status == 200  # already streaming when the deadline passed: vLLM's error event, then [DONE]
            events = [e for e in (await r.read()).decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and len(events) == 3
            check_proxy_error(504, json.loads(events[1][6:]), r.headers["X-Request-Id"], "0.5s")
        await asyncio.wait_for(d.cancelled.wait(), 5)
        await _idle(s, url)

    run_scenario([Fake("prefill")], [d], scenario, request_timeout_s=0.5, queue_timeout_s=0.4)
    deadline = [line for line in proxy_log if "--request-timeout" in line]
    assert len(deadline) == 2 and "during decode on http://127.0.0.1:" in deadline[0], proxy_log


def test_request_body_cap() -> None:
    p = Fake("prefill")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": "x" * 1800}) as r:
            assert r.status == 200
        async with s.post(url + "/v1/completions", json={"prompt": "x" * 5000}) as r:
            assert r.status == 413
            check_proxy_error(413, await r.json(), r.headers["X-Request-Id"], "2048 bytes")
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"x" * 4096

        async with s.post(url + "/v1/completions", data=chunks()) as r:  # chunked: no Content-Length
            assert r.status == 413

    run_scenario([p], [Fake("decode")], scenario, max_body_bytes=2048)
    assert len(p.received) == 1


def test_client_request_id_bounded_forwarded_and_returned(proxy_log: list[str]) -> None:
    p, d = Fake("prefill"), Fake("decode")
    returned: list[str] = []

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        for rid in ("chatcmpl-Abc.1:2_3", "x" * 129, "id with spaces", "<script>", ""):
            async with s.post(url + "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": rid}) as r:
                assert r.status == 200
                returned.append(r.headers["X-Request-Id"])
        async with s.get(url + "/v1/models", headers={"X-Request-Id": "m-1"}) as r:
            assert r.headers["X-Request-Id"] == "m-1"

    run_scenario([p], [d], scenario)
    assert returned[0] == "chatcmpl-Abc.1:2_3"
    assert all(r.startswith("lynx-") and len(r) == 37 for r in returned[1:]) and len(set(returned)) == 5
    assert p.request_ids == d.request_ids == returned  # P and D see the proxy's correlation id
    refused = [line for line in proxy_log if "X-Request-Id was not used" in line]
    assert len(refused) == 4 and all(f"request {r}:" in line for r, line in zip(returned[1:], refused, strict=True))
    assert "longer than 128" in refused[0] and "characters outside" in refused[1]


def test_lynx_report_reaches_d_only_when_the_client_asks() -> None:
    p, d = Fake("prefill"), Fake("decode")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        for params in ({"lynx_report": True, "lynx_mode": "int8"}, {"lynx_report": "yes"}, None):
            async with s.post(url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": params}) as r:
                assert r.status == 200

    run_scenario([p], [d], scenario)
    assert d.received[0]["kv_transfer_params"] == {**P_PARAMS, "lynx_report": True}
    assert d.received[1]["kv_transfer_params"] == d.received[2]["kv_transfer_params"] == P_PARAMS
    assert "lynx_report" not in p.received[0]["kv_transfer_params"]
    assert p.received[0]["kv_transfer_params"]["lynx_mode"] == "int8"


class EchoFake(Fake):
    """D answering each prompt with its own text and usage, as vLLM numbers one prompt's choices."""

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.role == "prefill":
            return await super().generate(request)
        body = await request.json()
        self.received.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id"))
        prompt = body["prompt"]
        return web.json_response({"id": "d", "object": "text_completion", "kv_transfer_params": None,
                                  "choices": [{"index": j, "text": f"{prompt}/{j}"} for j in range(body.get("n", 1))],
                                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": 2,
                                            "total_tokens": len(prompt) + 2}})


def test_a_list_of_prompts_is_one_request_per_prompt() -> None:
    """vLLM's answer to a list of prompts names one prompt's transfer only: the proxy sends each prompt as its own
    request (its own correlation id on P and D) and merges the answers as vLLM numbers them; streaming a list is
    refused with 400."""
    p, d = Fake("prefill"), EchoFake("decode")

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": ["a", "bb", "ccc"], "n": 2},
                          headers={"X-Request-Id": "batch-1"}) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        assert [(c["index"], c["text"]) for c in out["choices"]] == [
            (0, "a/0"), (1, "a/1"), (2, "bb/0"), (3, "bb/1"), (4, "ccc/0"), (5, "ccc/1")]
        assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
        async with s.post(url + "/v1/completions", json={"prompt": ["a", "b"], "stream": True}) as r:
            assert r.status == 400
            check_proxy_error(400, await r.json(), r.headers["X-Request-Id"], "separate requests")
        async with s.post(url + "/v1/completions", json={"prompt": [1, 2, 3]}) as r:  # token ids: one prompt
            assert r.status == 200
        # vLLM reads "stream" as pydantic reads a bool: "false" does not stream (the proxy refused the list)
        async with s.post(url + "/v1/completions", json={"prompt": ["a", "b"], "stream": "false"}) as r:
            assert r.status == 200, await r.text()

    run_scenario([p], [d], scenario)
    assert sorted(map(str, (b["prompt"] for b in p.received))) == ["[1, 2, 3]", "a", "a", "b", "bb", "ccc"]
    assert sorted(p.request_ids[:3]) == sorted(d.request_ids[:3]) == ["batch-1.0", "batch-1.1", "batch-1.2"]


def test_stream_is_read_as_vllm_reads_it() -> None:
    from lynx_connector.proxy_http import wants_stream

    for value, want in ((True, True), (False, False), (None, False), (1, True), (0, False), ("true", True),
                        (" Yes ", True), ("1", True), ("false", False), ("0", False), ("no", False), ("off", False)):
        assert wants_stream({"stream": value}) is want, value
    assert wants_stream({}) is False

