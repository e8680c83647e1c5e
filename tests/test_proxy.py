"""The P/D proxy against fake prefill and decode servers on 127.0.0.1 (no vLLM, no model)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from lynx_connector.proxy import ProxyConfig, build_prefill_request, create_app, normalize_url

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
            return web.json_response({"error": {"message": f"{self.role} says no"}}, status=self.status)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Scenario = Callable[[aiohttp.ClientSession, str], Awaitable[None]]


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
        proxy = TestServer(create_app(ProxyConfig(prefill=p_urls, decode=d_urls, **cfg)), host="127.0.0.1")
        await proxy.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                await scenario(session, str(proxy.make_url("")).rstrip("/"))
        finally:
            await proxy.close()
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


def _expect_error(status: int, *words: str) -> Scenario:
    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            assert r.status == status, await r.text()
            message = (await r.json())["error"]["message"]
        for word in words:
            assert word in message, message

    return scenario


def test_prefill_down() -> None:
    d = Fake("decode")
    run_scenario([None], [d], _expect_error(503, "prefill", "unreachable"))
    assert d.received == []


def test_decode_down() -> None:
    run_scenario([Fake("prefill")], [None], _expect_error(503, "decode", "unreachable"))


def test_prefill_without_kv_transfer_params() -> None:
    d = Fake("decode")
    run_scenario([Fake("prefill", kv_params=None)], [d], _expect_error(502, "prefill", "kv_transfer_params"))
    assert d.received == []


def test_prefill_refusing_the_clients_lynx_params_is_a_400_and_d_is_not_called() -> None:
    """P's scheduler half refuses a lynx_mode the operator does not allow (issue 14.6): its response carries a
    lynx_error instead of remote-prefill params; the proxy answers the client with it."""
    d = Fake("decode")
    err = {"message": "lynx_mode 'int4' is not allowed on this deployment (allowed_modes: full, speculative, bf16)",
           "type": "BadRequestError", "param": "kv_transfer_params.lynx_mode", "code": 400}
    run_scenario([Fake("prefill", kv_params={"lynx_error": err})], [d],
                 _expect_error(400, "prefill", "int4", "allowed_modes"))
    assert d.received == []


def test_upstream_errors() -> None:
    run_scenario([Fake("prefill", status=500)], [Fake("decode")], _expect_error(502, "prefill", "500"))
    run_scenario([Fake("prefill")], [Fake("decode", status=500)], _expect_error(502, "decode", "500"))
    # a client error (e.g. prompt too long) keeps its status and message
    run_scenario([Fake("prefill", status=400)], [Fake("decode")], _expect_error(400, "prefill says no"))


def test_bad_json_body() -> None:
    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400

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


def test_admission_refuses_at_once_when_the_queue_is_full_or_the_wait_too_long() -> None:
    d = SlowDecode()

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async def one() -> tuple[int, str]:
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                return r.status, (await r.json())["error"]["message"] if r.status != 200 else ""

        tasks = [asyncio.create_task(one()) for _ in range(4)]  # 1 in flight, 2 queued, 1 refused
        await asyncio.sleep(0.2)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        status, message = await one()  # the queue is full: refused at once
        assert status == 503 and "--max-queued 2" in message and loop.time() - t0 < 0.5
        # the gate stays shut: of the other three, two time out in the queue and one was refused at once
        results = await asyncio.gather(*tasks[1:])
        refused = [m for st, m in results if st == 503]
        assert len(refused) == 3 and sum("--queue-timeout" in m for m in refused) == 2
        d.gate.set()
        assert (await tasks[0])[0] == 200
        assert (await one())[0] == 200  # and the proxy serves again

    run_scenario([Fake("prefill")], [d], scenario, max_inflight=1, max_queued=2, queue_timeout_s=1.0)


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
