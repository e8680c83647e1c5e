"""Bounds shared by the configurations and the wire protocol (one source of truth).

``MAX_SECONDS`` bounds every duration a user can set (leases, timeouts, TTLs, waits): the side channel refuses a
``HelloOk.lease_s`` above it (docs/PROTOCOL.md), ``threading`` waits refuse timeouts past ``TIMEOUT_MAX`` (about
9.2e9 s), and a lease or timeout of more than eleven days is a typo, not a setting. A config past it is refused at
start-up, naming the setting, instead of failing every transfer at run time.
"""

from __future__ import annotations

import ipaddress
import re

MAX_SECONDS = 1e6

#: A host D can connect to over zmq: a DNS name or IPv4 address (labels of letters, digits, inner hyphens or
#: underscores, as container names have), or an IPv6 address in brackets (with a %zone). zmq refuses some others
#: at connect (".", "-", "_", "a b", "*"). D checks every P address it is handed against it; P's
#: ``side_channel_host`` (which P binds and tells D) is checked against it at start-up.
PEER_HOST = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)*"
                       r"|\[[0-9A-Fa-f:.]{2,45}(?:%[A-Za-z0-9_.-]{1,32})?\]")


def advertised_host_problem(host: str) -> str | None:
    """Why ``host`` cannot be the side-channel address P binds and tells D, or None when it can: it must be one
    address D connects to (not a wildcard such as ``0.0.0.0`` or ``[::]``, not a URL or ``host:port``): a host
    name, an IPv4 address or an IPv6 address in brackets (:func:`bracketed` writes a bare one so)."""
    if not PEER_HOST.fullmatch(host):
        return ("expected a host name, an IPv4 address or an IPv6 address that D connects to (no scheme, no port: "
                "the port is side_channel_port)")
    try:
        addr = ipaddress.ip_address(host[1:-1].split("%")[0] if host.startswith("[") else host)
    except ValueError:
        return "not an IPv6 address between the brackets" if host.startswith("[") else None
    if addr.is_unspecified:
        return "a wildcard address is where P listens, not one D can reach: use this host's address (e.g. the pod IP)"
    return None


def bracketed(host: str) -> str:
    """A bare IPv6 address (``fd00::5``, as ``$(POD_IP)`` expands in an IPv6 cluster) in brackets, as zmq's and
    URLs' ``host:port`` need it; anything else unchanged."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host.split("%")[0]).version == 6 else host
    except ValueError:
        return host
