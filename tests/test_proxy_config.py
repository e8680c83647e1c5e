"""``lynx proxy``'s options: each bad value is refused at start-up naming its option, as a usage error."""

from __future__ import annotations

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
