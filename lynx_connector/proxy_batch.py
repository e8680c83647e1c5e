"""The proxy's answer to a completion request with a list of prompts: one request per prompt, answers merged.

vLLM runs a list of ``k`` prompts as ``k`` requests, but its answer carries one ``kv_transfer_params``: P stages
every prompt's KV and names only the first, so D's other prompts would all present the first prompt's transfer
(refused as another prompt's, or racing for it) while P holds the others' staging until its lease. The proxy
therefore sends each prompt as a request of its own, through the usual flow (each its own admission slots and
correlation id ``<id>.<i>``), and merges the answers as vLLM numbers them: choice ``j`` of prompt ``i`` is index
``i * n + j``, usage summed. The first failure is the answer (the other prompts' calls are cancelled). Streaming a
list is refused with 400: its events would interleave the prompts' streams, which a client can do itself by
sending the prompts as separate requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from lynx_connector.proxy_http import error_response
from lynx_connector.proxy_upstream import Call

__all__ = ["prompt_list", "serve_prompt_list"]

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")

Serve = Callable[[Call, dict[str, Any]], Awaitable[web.StreamResponse]]


def prompt_list(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completion body that lists several (strings or token lists); None for one prompt (a
    list of token ids is one prompt)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2 or isinstance(prompt[0], int):
        return None
    return prompt


async def serve_prompt_list(serve: Serve, call: Call, body: dict[str, Any], prompts: list[Any]) -> web.StreamResponse:
    if body.get("stream"):
        return error_response(400, "lynx proxy: a list of prompts is answered only without streaming; send the "
                                   "prompts as separate requests to stream them", call.request_id)
    calls = [Call(f"{call.request_id}.{i}") for i in range(len(prompts))]
    tasks = [asyncio.ensure_future(serve(c, {**body, "prompt": p})) for c, p in zip(calls, prompts, strict=True)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
                raise exc  # the first failure is the answer: the other calls are cancelled below
        answers = [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for answer in answers:
        if answer.status != 200 or not isinstance(answer, web.Response) or answer.body is None:
            return answer
    return web.json_response(merge([json.loads(a.body) for a in answers]))  # type: ignore[arg-type]


def merge(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """One completion answer from one per prompt, in prompt order (vLLM's numbering and usage)."""
    merged = dict(outs[0])
    choices: list[dict[str, Any]] = []
    for out in outs:
        base = len(choices)
        choices.extend({**c, "index": base + int(c.get("index", 0))} for c in out.get("choices") or [])
    merged["choices"] = choices
    usages = [o.get("usage") for o in outs]
    if all(isinstance(u, dict) for u in usages):
        merged["usage"] = {**usages[0], **{k: sum(int(u.get(k) or 0) for u in usages) for k in USAGE_KEYS
                                           if k in usages[0]}}
    return merged
