"""Shared fixtures of the transport tests."""

from __future__ import annotations

import pytest

from .fakes import FakeFabric


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()
