"""The suite's two tiers.

``core`` (the default, what ``bash scripts/test.sh`` and CI run) holds every unit test and at least one real
vLLM + real NIXL test of each feature. ``extended`` tests (marked ``@pytest.mark.extended``) are real-engine
runs that repeat what a core test already covers, at a cost a 2-core CI machine cannot pay inside its budget:
the benchmarks' quick runs end to end, the image's torch.compile start, bf16 caches on a CPU without bf16
arithmetic, second variants of a fault. ``bash scripts/test.sh --extended`` runs both tiers; without the flag an
extended test is reported as skipped, with that command as the reason, never silently dropped.
"""

from __future__ import annotations

import pytest

EXTENDED_FLAG = "--extended"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"extended: the extended tier, skipped unless pytest runs with {EXTENDED_FLAG}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(EXTENDED_FLAG, action="store_true", default=False,
                     help="also run the extended tier (tests marked `extended`: minutes each on a small CPU)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption(EXTENDED_FLAG):
        return
    skip = pytest.mark.skip(reason=f"extended tier: run with `bash scripts/test.sh {EXTENDED_FLAG}`")
    for item in items:
        if item.get_closest_marker("extended") is not None:
            item.add_marker(skip)
