"""Speculative tests: the connector's scheduler half reads the deployment key at start-up (it verifies the signed
kv_transfer_params the harness sends as P would), so each test gets a fresh one."""

from __future__ import annotations

import secrets

import pytest


@pytest.fixture(autouse=True)
def side_channel_key(monkeypatch: pytest.MonkeyPatch) -> str:
    key = secrets.token_hex(32)
    monkeypatch.delenv("LYNX_SIDE_CHANNEL_KEY_FILE", raising=False)
    monkeypatch.setenv("LYNX_SIDE_CHANNEL_KEY", key)
    return key
