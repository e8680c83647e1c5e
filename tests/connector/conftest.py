"""Connector tests: every worker reads the side-channel key at start-up, so each test gets a fresh one."""

from tests.side_channel_key import side_channel_key  # noqa: F401  (an autouse fixture)
