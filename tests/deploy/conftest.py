"""Deploy tests: the `netns` marker (needs root + iproute2; registered here too so the suite runs warning-free
before pyproject.toml lists it) and a session sweep of namespaces left by killed test runs."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "netns: needs root and iproute2 (network namespaces, veth, tc)")


@pytest.fixture(scope="session", autouse=True)
def _sweep_stale_namespaces() -> None:
    from lynx_connector.lab import netns

    if netns.available()[0]:
        netns.cleanup_stale()
