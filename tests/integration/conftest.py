"""Fixtures of the real-engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model() -> str:
    """The real model's folder (skips when the set-up has not converted it)."""
    from lynx_connector.lab.models import is_prepared, model_dir

    if not is_prepared():
        pytest.skip("the real model is not prepared (scripts/setup_env.sh prepares it)")
    return str(model_dir())
