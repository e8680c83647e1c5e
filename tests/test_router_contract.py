"""What vllm-router (0.1.17, `--vllm-pd-disaggregation`, the dev extra) sends to P and D, pinned against the
real router binary with fake prefill and decode servers on 127.0.0.1 (no vLLM, no model; seconds). These are
the router's behaviours docs/OPERATIONS.md ("Front ends") states; tests/integration/test_vllm_router.py runs
the same router in front of real Lynx servers."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from lynx_connector.lab.router import router_installed

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1", "remote_port": 5600,
            "lynx_transfer_id": "t-1", "lynx_token": "00" * 16, "lynx_mode": "full"}


class FakeServer:
    """A vLLM-like server recording each generate request (body, X-Request-Id); P answers ``answer``."""

    def __init__(self, role: str, answer: dict[str, Any]) -> None:
        self.role, self.answer = role, answer
        self.received: list[tuple[dict[str, Any], str | None]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # /health, /v1/models, whatever the router probes
                self._send({"object": "list", "data": [{"id": "tiny"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.received.append((body, self.headers.get("X-Request-Id")))
                self._send(fake.answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


D_ANSWER = {"id": "d", "object": "text_completion", "choices": [{"index": 0, "text": "Hello", "finish_reason": "length"}],
            "kv_transfer_params": None}


@pytest.fixture
def router(tmp_path) -> Iterator[Any]:
    """``start(p_answer)``: a fake P answering ``p_answer``, a fake D and a router before them; all stopped after."""
    from lynx_connector.lab.router import router_server, wait_healthy

    if not router_installed():
        pytest.fail("vllm-router is not installed: scripts/setup_env.sh installs it with the dev extra")
    fakes: list[FakeServer] = []
    routers: list[Any] = []

    def start(p_answer: dict[str, Any]) -> tuple[Any, FakeServer, FakeServer]:
        p, d = FakeServer("prefill", p_answer), FakeServer("decode", D_ANSWER)
        fakes.extend([p, d])
        r = router_server("router", tmp_path, [p.url], [d.url], extra=["--disable-retries"])
        routers.append(r)
        r.start()
        wait_healthy(r, 60)
        return r, p, d

    yield start
    for r in routers:
        r.stop()
    for f in fakes:
        f.close()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


CLIENT = {"model": "tiny", "prompt": "Hi", "max_tokens": 7, "temperature": 0,
          "kv_transfer_params": {"lynx_mode": "int8"}}


def test_p_gets_the_routers_params_and_d_gets_ps(router):
    r, p, d = router({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": P_PARAMS})
    out = _post(r.url + "/v1/completions", CLIENT)
    assert out["choices"][0]["text"] == "Hello"  # D's answer, passed through
    [(p_body, p_rid)], [(d_body, d_rid)] = p.received, d.received
    # P: one token, not streamed, and the router's own kv_transfer_params: the client's lynx_mode is gone
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert "lynx_mode" not in p_body["kv_transfer_params"]
    # D: the client's request with P's kv_transfer_params, verbatim
    assert d_body["max_tokens"] == CLIENT["max_tokens"] and d_body["prompt"] == CLIENT["prompt"]
    assert d_body["kv_transfer_params"] == P_PARAMS
    # one X-Request-Id for both
    assert p_rid and p_rid == d_rid


def test_a_prefill_answer_without_params_still_goes_to_d(router):
    """A P that returns no kv_transfer_params does not fail the request: D gets the client's own params (no
    remote prefill in them) and so prefills the prompt itself (docs/OPERATIONS.md: watch D's local_compute
    prompt tokens)."""
    r, p, d = router({"id": "p", "choices": [{"text": "x"}]})
    out = _post(r.url + "/v1/completions", CLIENT)
    assert out["choices"][0]["text"] == "Hello"
    [(d_body, _)] = d.received
    assert d_body["kv_transfer_params"] == CLIENT["kv_transfer_params"]
