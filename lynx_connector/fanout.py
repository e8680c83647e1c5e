"""Requests vLLM splits into children (``n > 1``, parallel sampling): one P transfer per child.

vLLM's ``AsyncLLM`` turns a request with ``n > 1`` into ``n`` engine requests with ids ``f"{i}_{parent_id}"``
(``vllm/v1/engine/parallel_sampling.py``, ``ParentRequest.get_child_info``), each with a copy of the request's
``kv_transfer_params``, and answers (non-streaming, which is how every P/D front end calls P) once all children
have finished, with the ``kv_transfer_params`` of the child that finished last. On P every child is an ordinary
request: its prompt is staged under its own transfer id and token. On D every child is an ordinary pull. What
joins them is this module:

- P (:class:`SiblingBook`): when a child finishes, its (request id, transfer id, token, first token) is added to
  its parent's group and the child's ``kv_transfer_params`` list every sibling finished so far under
  ``lynx_children``. The child that finishes last (the one whose params reach the response) therefore lists all
  of them: P's ``request_finished`` runs in the order the engine's outputs are processed.
- D (:func:`lynx_connector.metadata.RemotePrefill.from_params` with the request id): child ``i`` pulls the entry
  whose ``child`` is ``i``; a child P's answer does not list (P's sibling was aborted or never staged) computes
  its prompt locally, as for any unusable params.

So each P staging is pulled by exactly one D child and freed by that child's Done: no shared staging, no Done
counting, no wire change. A group is kept ``keep_s`` (P's lease: the stagings it names are gone after it).
Parent ids are vLLM's internal ids (the external id plus 8 random characters), so two clients never share a
group. With data-parallel P engines the children may land on different engines; a child whose sibling is
missing from the list is served by a local prefill (correct, slower).
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from typing import Any

#: kv_transfer_params key holding every P child of a parent request (a list of :data:`CHILD_KEYS` dicts + child).
CHILDREN_KEY = "lynx_children"
#: The keys that differ between the children of one request; each ``lynx_children`` entry carries them.
CHILD_KEYS = ("remote_request_id", "lynx_transfer_id", "lynx_token", "lynx_first_token")
#: At most this many children in one list (vLLM's ``n`` is small; the cap bounds untrusted input on D, and P's
#: cost: every child's params list its siblings so far, so a parent costs P quadratic time in its children).
MAX_CHILDREN = 256


class TooManyChildren(ValueError):
    """A parent request with more than :data:`MAX_CHILDREN` children: not served by remote prefill."""

_CHILD_ID = re.compile(r"(0|[1-9][0-9]{0,8})_(.+)", re.DOTALL)


def child_of(req_id: str) -> tuple[int, str] | None:
    """``(index, parent id)`` of a vLLM child request id (``f"{index}_{parent}"``), None for any other id."""
    m = _CHILD_ID.fullmatch(req_id)
    return (int(m.group(1)), m.group(2)) if m else None


class SiblingBook:
    """P: the finished children of each parent request, for the ``lynx_children`` list of their params."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._groups: OrderedDict[str, tuple[float, list[dict[str, Any]]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, req_id: str, params: dict[str, Any], now: float | None = None) -> list[dict[str, Any]] | None:
        """Record the finished child ``req_id`` with its own ``params``; the list of its parent's children so far
        (itself included), or None when ``req_id`` is not a child's id."""
        now = time.monotonic() if now is None else now
        self._prune(now)
        parsed = child_of(req_id)
        if parsed is None:
            return None
        index, parent = parsed
        entry = {"child": index, **{k: params[k] for k in CHILD_KEYS if k in params}}
        _, group = self._groups.setdefault(parent, (now, []))
        group[:] = [e for e in group if e["child"] != index]
        if len(group) >= MAX_CHILDREN:
            raise TooManyChildren(f"request {parent!r} has more than {MAX_CHILDREN} children (n): remote prefill "
                                  f"serves at most {MAX_CHILDREN}")
        group.append(entry)
        return [dict(e) for e in group]

    def _prune(self, now: float) -> None:
        while self._groups:
            parent, (t0, _) = next(iter(self._groups.items()))
            if now - t0 < self.keep_s:
                return
            del self._groups[parent]
