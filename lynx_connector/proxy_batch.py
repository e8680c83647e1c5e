"""The proxy's answer to a completion request with a list of prompts: one request per prompt, answers merged.

vLLM runs a list of ``k`` prompts as ``k`` requests, but its answer carries one ``kv_transfer_params``: P stages
every prompt's KV and names only the first, so D's other prompts would all present the first prompt's transfer
(refused as another prompt's, or racing for it) while P holds the others' staging until its lease. The proxy
therefore sends each prompt as a request of its own, through the usual flow (each its own admission slots and
correlation id ``<id>.<i>``), and merges the answers as vLLM numbers them: choice ``j`` of prompt ``i`` is index
``i * n + j``, usage summed. The first failure is the answer (the other prompts' calls are cancelled). Streaming a
list is refused with 400: its events would interleave the prompts' streams, which a client can do itself by
sending the prompts as separate requests.

The prompts are counted as vLLM counts them: ``prompt_embeds`` entries first, then ``prompt`` entries. At most
``concurrency`` prompts of one list are in flight at once (``--max-inflight``): a long list takes its turn in the
admission queue instead of filling it, and a list longer than ``MAX_PROMPTS`` (vLLM's own limit,
``VLLM_MAX_COMPLETION_PROMPTS``'s default) is refused with 400.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from lynx_connector.proxy_http import ProxyError, error_response, wants_stream
from lynx_connector.proxy_upstream import Call

__all__ = ["MAX_PROMPTS", "prompt_list", "serve_prompt_list"]

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")
MAX_PROMPTS = 1024
PROMPT_KEYS = ("prompt_embeds", "prompt")  # vLLM's order: embeddings first

Serve = Callable[[Call, dict[str, Any]], Awaitable[web.StreamResponse]]


def _seq(value: Any) -> list[Any]:
    """One prompt field as a list of prompts (a string or a list of token ids is one prompt; an empty list is
    none, as vLLM counts it)."""
    if isinstance(value, list) and (not value or not isinstance(value[0], int)):
        return value
    return [value]


def prompt_list(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The prompts of a completion body that has several, each as the field that carries it (``{"prompt": p}``
    or ``{"prompt_embeds": e}``); None for one prompt."""
    items = [{key: one} for key in PROMPT_KEYS if body.get(key) is not None for one in _seq(body[key])]
    return items if len(items) >= 2 else None


async def serve_prompt_list(serve: Serve, call: Call, body: dict[str, Any], prompts: list[dict[str, Any]],
                            concurrency: int) -> web.StreamResponse:
    if wants_stream(body):
        return error_response(400, "lynx proxy: a list of prompts is answered only without streaming; send the "
                                   "prompts as separate requests to stream them", call.request_id)
    if len(prompts) > MAX_PROMPTS:
        return error_response(400, f"lynx proxy: a request may list at most {MAX_PROMPTS} prompts, got "
                                   f"{len(prompts)}", call.request_id)
    call.phase = f"{len(prompts)} prompts"
    base = {k: v for k, v in body.items() if k not in PROMPT_KEYS}
    turns = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: dict[str, Any]) -> web.StreamResponse:
        async with turns:
            return await serve(Call(f"{call.request_id}.{i}"), {**base, **prompt})

    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
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
    try:
        outs = [json.loads(a.body) for a in answers]  # type: ignore[arg-type]
        if not all(isinstance(o, dict) for o in outs):
            raise ValueError("an answer is not a JSON object")
        return web.json_response(merge(outs, call.request_id))
    except (ValueError, TypeError) as e:
        raise ProxyError(502, "decode server error", f"decode server answered a prompt of the list with an "
                                                     f"unusable body: {e}") from None


def merge(outs: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    """One completion answer from one per prompt, in prompt order, as vLLM answers a list: choice ``j`` of prompt
    ``i`` is index ``i * n + j``, usage summed (cached tokens too), the id the request's own (``cmpl-<id>``, not
    its first prompt's ``cmpl-<id>.0``), no per-request ``metrics``."""
    merged = dict(outs[0])
    merged.pop("metrics", None)
    first_id = merged.get("id")
    if isinstance(first_id, str) and first_id.endswith(f"{request_id}.0"):
        merged["id"] = first_id[:-2]
    choices: list[dict[str, Any]] = []
    for out in outs:
        base = len(choices)
        choices.extend({**c, "index": base + int(c.get("index", 0))} for c in out.get("choices") or [])
    merged["choices"] = choices
    usages = [o.get("usage") for o in outs]
    if all(isinstance(u, dict) for u in usages):
        merged["usage"] = {**usages[0], **{k: sum(int(u.get(k) or 0) for u in usages) for k in USAGE_KEYS
                                           if k in usages[0]}}
        details = [u.get("prompt_tokens_details") for u in usages]
        if all(isinstance(d, dict) and isinstance(d.get("cached_tokens"), int) for d in details):
            merged["usage"]["prompt_tokens_details"] = {**details[0],  # type: ignore[dict-item]
                                                        "cached_tokens": sum(d["cached_tokens"] for d in details)}
    return merged
