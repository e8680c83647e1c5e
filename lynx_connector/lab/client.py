"""A small streaming OpenAI-completions client that timestamps every token: TTFT and time to the k-th token
are what Lynx changes, so they are measured at the client, through the proxy, like a user sees them."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamResult:
    text: str = ""
    #: Seconds from sending the request to the arrival of each generated token (from per-chunk usage counts).
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    total_s: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def time_to_token(self, k: int) -> float | None:
        """Seconds to the k-th streamed token (1-based); None if fewer arrived."""
        return self.token_times[k - 1] if len(self.token_times) >= k else None


def stream_completion(base_url: str, model: str, prompt: str | list[int], *, max_tokens: int = 32,
                      kv_transfer_params: dict[str, Any] | None = None, timeout: float = 600.0,
                      extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> StreamResult:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True,
                            # per-chunk token counts: a verification step releases several tokens at once
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    body.update(extra or {})
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                                          **(headers or {})})
    out = StreamResult()
    n_tokens = 0
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    break
                now = time.perf_counter() - t0
                for choice in chunk.get("choices", []):
                    out.text += choice.get("text") or ""
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage") or {}
                total = usage.get("completion_tokens")
                if isinstance(total, int) and total > n_tokens:
                    out.token_times.extend([now] * (total - n_tokens))
                    n_tokens = total
    except urllib.error.HTTPError as exc:
        out.error = f"HTTP {exc.code}: {exc.read().decode('utf-8', 'replace')[:500]}"
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.total_s = time.perf_counter() - t0
    return out
