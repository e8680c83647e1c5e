"""Speculative tests: the connector's scheduler half reads the deployment key at start-up (it verifies the signed
kv_transfer_params the harness sends as P would), so each test gets a fresh one."""

import pytest

from tests.side_channel_key import side_channel_key  # noqa: F401  (an autouse fixture)
from tests.speculative.sched_harness import model_config, tiny_model_dir


@pytest.fixture(scope="module")
def mc(tmp_path_factory):
    """The tiny model's vLLM model config the scheduler harness builds schedulers from."""
    return model_config(tiny_model_dir(tmp_path_factory.mktemp("tiny")))
