"""Bounds shared by the configurations and the wire protocol (one source of truth).

``MAX_SECONDS`` bounds every duration a user can set (leases, timeouts, TTLs, waits): the side channel refuses a
``HelloOk.lease_s`` above it (docs/PROTOCOL.md), ``threading`` waits refuse timeouts past ``TIMEOUT_MAX`` (about
9.2e9 s), and a lease or timeout of more than eleven days is a typo, not a setting. A config past it is refused at
start-up, naming the setting, instead of failing every transfer at run time.
"""

from __future__ import annotations

MAX_SECONDS = 1e6
