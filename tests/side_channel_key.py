"""The deployment key fixture of the test folders whose code reads the side-channel key at start-up (worker and
scheduler halves: they authenticate the side channel and sign or verify kv_transfer_params); each test gets a
fresh key. A folder's conftest imports it (autouse there)."""

from __future__ import annotations

import secrets

import pytest


@pytest.fixture(autouse=True)
def side_channel_key(monkeypatch: pytest.MonkeyPatch) -> str:
    key = secrets.token_hex(32)
    monkeypatch.delenv("LYNX_SIDE_CHANNEL_KEY_FILE", raising=False)
    monkeypatch.setenv("LYNX_SIDE_CHANNEL_KEY", key)
    return key
