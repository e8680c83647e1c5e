"""``lynx proxy``'s options: each bad value is refused at start-up naming its option, as a usage error."""

from __future__ import annotations

import json

import pytest

from lynx_connector import cli
from lynx_connector.proxy import ProxyConfig

BASE = {"prefill": ["127.0.0.1:8100"], "decode": ["127.0.0.1:8200"]}


@pytest.mark.parametrize("change, option", [
    ({"prefill": ["127.0.0.1:8100", "http://127.0.0.1:8100/"]}, "--prefill"),  # one server, two spellings
    ({"decode": ["127.0.0.1:8200", "127.0.0.1:8200"]}, "--decode"),
    ({"prefill": [""]}, "--prefill"),
    ({"prefill": ["127.0.0.1:99999"]}, "--prefill"),
    ({"decode": ["ftp://127.0.0.1:8200"]}, "--decode"),
    ({"decode": ["http://127.0.0.1:8200/?x=1"]}, "--decode"),
    ({"read_timeout_s": -1.0}, "--read-timeout"),  # every request would time out at once (504)
    ({"connect_timeout_s": float("nan")}, "--connect-timeout"),
    ({"health_timeout_s": -5.0}, "--health-timeout"),
    ({"queue_timeout_s": 0.0}, "--queue-timeout"),
    ({"request_timeout_s": float("inf")}, "--request-timeout"),
    ({"params_ttl_s": float("inf")}, "--params-ttl"),  # every pipelined request failed signing (500)
    ({"params_ttl_s": 2e6}, "--params-ttl"),
    ({"max_inflight": 0}, "--max-inflight"),
    ({"max_queued": -1}, "--max-queued"),
    ({"max_body_bytes": 10}, "--max-body-bytes"),
    ({"port": 70000}, "--port"),
    ({"port": -1}, "--port"),
    ({"flow": "parallel"}, "--flow"),
])
def test_bad_values_name_their_option(change: dict, option: str) -> None:
    with pytest.raises(ValueError, match=option):
        ProxyConfig(**{**BASE, **change})


def test_a_url_with_credentials_is_refused_without_repeating_them() -> None:
    """``http://ops:s3cret@host`` worked (aiohttp's basic auth) and showed the password in the logs and in every
    client's /health answer."""
    for url in ("http://ops:s3cret@127.0.0.1:8100", "ops:s3cret@127.0.0.1:8100", "http://s3cret@127.0.0.1:8100"):
        with pytest.raises(ValueError, match="--prefill http://127.0.0.1:8100: a URL with credentials") as err:
            ProxyConfig(**{**BASE, "prefill": [url]})
        assert "s3cret" not in str(err.value)


def test_a_relayed_error_names_its_kind_but_not_its_body() -> None:
    """P's or D's 4xx is logged at INFO when relayed; vLLM's validation errors quote the offending input (a chat
    message: the user's text), so the line names the error's type and param, and the body is left to DEBUG."""
    from lynx_connector.proxy_http import Passthrough

    body = json.dumps({"error": {"message": "Input should be a valid list [input_value='my secret prompt']",
                                 "type": "BadRequestError", "param": "messages", "code": 400}}).encode()
    assert str(Passthrough("decode", 400, body, "application/json")) == \
        "decode answered HTTP 400 (BadRequestError, param messages)"
    assert str(Passthrough("prefill", 404, b"not json", "text/plain")) == "prefill answered HTTP 404"
    assert str(Passthrough("prefill", 400, b'{"error": "x"}', "application/json")) == "prefill answered HTTP 400"


def test_urls_are_normalized_and_a_path_prefix_is_kept() -> None:
    cfg = ProxyConfig(prefill=["127.0.0.1:8100/", "https://127.0.0.1:8443/vllm"], decode=["http://127.0.0.1:8200"])
    assert cfg.prefill == ["http://127.0.0.1:8100", "https://127.0.0.1:8443/vllm"]
    assert cfg.decode == ["http://127.0.0.1:8200"]


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--read-timeout", "-1"], "--read-timeout must be"),
    (["--prefill", "http://127.0.0.1:8100/"], "names the same server"),
])
def test_lynx_proxy_reports_a_bad_value_as_a_usage_error(args: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["proxy", "--prefill", "127.0.0.1:8100", "--decode", "127.0.0.1:8200", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "lynx proxy: error:" in err and "Traceback" not in err


def test_a_queue_timeout_not_shorter_than_the_request_timeout_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    """Valid, but a request still queued would get the request timeout's 504, not the queue's 503: said once at
    start-up (the defaults, 120 s and 1800 s, say nothing)."""
    ProxyConfig(**BASE)
    assert "--queue-timeout" not in caplog.text
    ProxyConfig(**BASE, queue_timeout_s=60.0, request_timeout_s=30.0)
    assert "--queue-timeout 60s is not shorter than --request-timeout 30s" in caplog.text


def _proxy_argv(port: int) -> list[str]:
    import sys

    return [sys.executable, "-m", "lynx_connector.cli", "proxy", "--prefill", "127.0.0.1:8100", "--decode",
            "127.0.0.1:8200", "--host", "127.0.0.1", "--port", str(port), "--flow", "sequential"]


def test_a_port_in_use_is_one_line_naming_it() -> None:
    """Review: the proxy logged that it listened, then died with asyncio's OSError traceback."""
    import socket
    import subprocess

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        done = subprocess.run(_proxy_argv(port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120)
    assert done.returncode == 1, done.stdout
    assert f"cannot listen on 127.0.0.1:{port} (--host, --port): Address already in use" in done.stdout, done.stdout
    assert "Traceback" not in done.stdout and "Lynx proxy on" not in done.stdout


def test_port_0_logs_the_port_it_got_and_the_open_file_limit_is_raised() -> None:
    """``--port 0`` takes a free port and the log names it (review: it said ``:0``); a soft open-file limit of
    256 is raised toward 65535 as vLLM raises its own (review: at 256 the proxy answered 503s naming P or D)."""
    import json
    import re
    import resource
    import subprocess
    import time
    import urllib.request

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.Popen(_proxy_argv(0), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=low_limit)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "Lynx proxy on" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline() or line
        port = int(re.search(r"Lynx proxy on http://127\.0\.0\.1:(\d+)", line).group(1))
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lynx/stats", timeout=30) as resp:
            assert json.load(resp)["flow"] == "sequential"
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        limits = open(f"/proc/{proc.pid}/limits").read()
        soft = int(re.search(r"Max open files\s+(\d+)", limits).group(1))
        assert soft == (65535 if hard == resource.RLIM_INFINITY else min(65535, hard)) > 256, limits
    finally:
        proc.terminate()
        proc.wait(timeout=30)
