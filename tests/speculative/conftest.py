"""Speculative tests: the connector's scheduler half reads the deployment key at start-up (it verifies the signed
kv_transfer_params the harness sends as P would), so each test gets a fresh one."""

from tests.side_channel_key import side_channel_key  # noqa: F401  (an autouse fixture)
