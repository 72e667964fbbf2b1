"""One streaming `/v1/completions` request, timed chunk by chunk (SSE over httpx)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds, send -> first content chunk
    latency: float = 0.0  # seconds, send -> end of stream
    itl: list[float] = field(default_factory=list)  # gaps between later content chunks


class ChunkClock:
    """Times one stream into `result`: TTFT at the first content chunk, the gaps between later
    ones, the latency at the end; `chunks` counts the content chunks."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.start = self.last = time.perf_counter()
        self.chunks = 0

    def content_chunk(self) -> None:
        now = time.perf_counter()
        if self.chunks == 0:
            self.result.ttft = now - self.start
        else:
            self.result.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def finish(self) -> None:
        self.result.latency = time.perf_counter() - self.start


async def first_model(client: Any, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


async def stream_completion(client: Any, base_url: str, model: str, prompt: list[int],
                            max_tokens: int) -> RequestResult:
    """Streams one completion of exactly `max_tokens` tokens (ignore_eos) for a token-id
    prompt; failures are recorded, never raised."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(prompt))
    clock = ChunkClock(result)
    usage_tokens = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                choices = event.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue  # usage-only chunk, or text held back (partial character)
                clock.content_chunk()
    except Exception as error:  # noqa: BLE001 - a benchmark reports failures, it goes on
        result.error = f"{type(error).__name__}: {error}"
        return result
    clock.finish()
    result.output_tokens = usage_tokens if usage_tokens is not None else clock.chunks
    result.success = clock.chunks > 0
    if not result.success:
        result.error = "no content chunk received"
    return result
