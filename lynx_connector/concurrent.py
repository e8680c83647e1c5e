"""The concurrent flow (pipelined transfer, issue 15; docs/PROTOCOL.md section 6): the proxy sends a request to
P and to D at the same time, so D allocates its blocks and is ready to pull while P still computes the prompt.

D must then know, before P has answered anything, where to pull from and what to present: the proxy learns each
P's side channel once (from the kv_transfer_params of a request that prefill served the sequential way: engine
id, host, ports, KV dtype; :class:`PrefillEndpoint`), mints the request's transfer id and token itself (16
random bytes each, never client-chosen), and signs both requests' params with the deployment key (the same
HMAC as P's, lynx_connector/signing.py):

- to P: ``do_remote_decode``, ``lynx_flow: "concurrent"``, ``lynx_transfer_id``, ``lynx_token``, ``lynx_mode``.
  P stages the request under exactly that id and token, and only when the signature verifies (else the request
  is refused with a 400-style ``lynx_error``: a client cannot choose a transfer id).
- to D: the usual remote-prefill params with ``lynx_flow: "concurrent"`` and ``remote_num_tokens: 0`` ("the
  whole prompt": the proxy has not tokenised it; D and P count the same prompt with the same tokenizer, and a
  mismatch fails the pull on the region sizes). D's pull waits up to ``concurrent_wait_s`` for P to start
  publishing (P's "unknown request" means "not yet" meanwhile). No ``lynx_first_token`` (P has sampled nothing
  yet: it reaches a speculative D later, through P's side channel, ``Regions.first_token``) and no prompt digest
  (the proxy never sees token ids; the params reach D only from the proxy).

Pure Python (no vLLM, no torch).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

__all__ = ["CONCURRENT", "FLOW_KEY", "FLOWS", "LYNX_PARAMS_VERSION", "TICKET_REASON_KEY", "PrefillEndpoint",
           "decode_params", "mint", "prefill_params"]

#: Version of the kv_transfer_params / side-channel contract; D refuses a P that speaks another one.
LYNX_PARAMS_VERSION = 2
FLOW_KEY = "lynx_flow"
CONCURRENT = "concurrent"
#: The proxy's flows: "sequential" (P answers, then D is asked: what vLLM's router and NixlConnector speak) and
#: "pipelined" (concurrent dispatch to P and D, layer-wise publish on P).
FLOWS: tuple[str, ...] = ("sequential", "pipelined")
#: In P's ``lynx_error`` for a refused concurrent-flow ticket: why (signing.REFUSAL_REASONS). The proxy minted and
#: signed that ticket, so the refusal is its own fault (a clock behind P's by over --params-ttl, another key), not
#: the client's: it sends the request the sequential way instead (proxy_flow.py).
TICKET_REASON_KEY = "lynx_reason"


def mint() -> tuple[str, str]:
    """A new (transfer_id, token) for a concurrent-flow request (16 random bytes each, hex)."""
    return secrets.token_hex(16), secrets.token_hex(16)


@dataclass(frozen=True)
class PrefillEndpoint:
    """Where a prefill instance's side channel is, as its own remote-prefill params said."""

    engine_id: str
    host: str
    ports: tuple[int, ...]
    kv_dtype: str = ""

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> PrefillEndpoint | None:
        """From the kv_transfer_params a P returned (None when they do not name a Lynx side channel)."""
        try:
            ports = params.get("lynx_ports") or [params["remote_port"]]
            engine_id, host = params["remote_engine_id"], params["remote_host"]
        except (KeyError, TypeError):
            return None
        if not (isinstance(engine_id, str) and isinstance(host, str) and isinstance(ports, list) and ports
                and all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)):
            return None
        kv_dtype = params.get("lynx_kv_dtype", "")
        return cls(engine_id, host, tuple(ports), kv_dtype if isinstance(kv_dtype, str) else "")


def prefill_params(transfer_id: str, token: str, mode: str) -> dict[str, Any]:
    """What the proxy sends P (to be signed): stage this request under this id and token."""
    return {"do_remote_decode": True, "do_remote_prefill": False, FLOW_KEY: CONCURRENT,
            "lynx_transfer_id": transfer_id, "lynx_token": token, "lynx_mode": mode}


def decode_params(endpoint: PrefillEndpoint, request_id: str, transfer_id: str, token: str,
                  mode: str) -> dict[str, Any]:
    """What the proxy sends D (to be signed): pull this request from ``endpoint`` once P publishes it."""
    params: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False, FLOW_KEY: CONCURRENT,
        "remote_engine_id": endpoint.engine_id, "remote_request_id": request_id[:1024] or "concurrent",
        "remote_host": endpoint.host, "remote_port": endpoint.ports[0], "lynx_ports": list(endpoint.ports),
        "remote_num_tokens": 0, "lynx_mode": mode, "lynx_version": LYNX_PARAMS_VERSION,
        "lynx_transfer_id": transfer_id, "lynx_token": token,
    }
    if endpoint.kv_dtype:
        params["lynx_kv_dtype"] = endpoint.kv_dtype
    return params
