"""A soak of a running `mrv2 serve`: many requests of a fixed mix, the resident memory of the
server's processes read between rounds. Used by bench/soak.py (the built-in model, thousands
of requests) and by the server tests (the tiny model, a few hundred).

The mix repeats every `len(REQUEST_KINDS)` requests, so everything a request shape warms up
(compiled grammars, tokenizer caches, prefix-cache entries up to the pool's size) is warm
after the first round; memory that keeps growing after that is a leak. Disconnects (streamed
and not) and rejected requests are part of the mix: their paths must free what they took.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# One JSON schema for every structured request: its compiled grammar is cached once.
SOAK_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False}

REQUEST_KINDS = ("completion", "chat_stream", "chat_stream_disconnect",
                 "completion_disconnect", "chat_n2_logprobs", "chat_json_schema",
                 "completion_stop", "bad_request")

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
          "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (VmRSS from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass
class SoakResult:
    """Outcome counts per kind and the RSS samples: (requests done, {process name: bytes})."""
    outcomes: Counter = field(default_factory=Counter)
    samples: list[tuple[int, dict[str, int]]] = field(default_factory=list)

    def growth(self, process: str, after: int) -> float:
        """Relative RSS growth of `process` from the first sample at >= `after` requests to
        the last sample."""
        start = next(s[process] for done, s in self.samples if done >= after)
        return self.samples[-1][1][process] / start - 1.0


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24)))


async def _one(client: Any, model: str, kind: str, rng: random.Random) -> str:
    """Sends one request of `kind`; returns its outcome ("ok", "disconnected", "rejected")
    and raises on anything a client must not see (a 5xx, a malformed answer)."""
    prompt = _prompt(rng)
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}]}
    if kind == "completion":
        body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, 12)}
        out = (await _post(client, "/v1/completions", body)).json()
        assert out["choices"][0]["finish_reason"] in ("length", "stop"), out
        return "ok"
    if kind == "completion_stop":
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "stop": [" a", "e"],
                "logprobs": 1, "echo": True}
        (await _post(client, "/v1/completions", body)).json()
        return "ok"
    if kind == "chat_n2_logprobs":
        body = {**chat, "max_tokens": 6, "n": 2, "logprobs": True, "top_logprobs": 2}
        out = (await _post(client, "/v1/chat/completions", body)).json()
        assert len(out["choices"]) == 2, out
        return "ok"
    if kind == "chat_json_schema":
        body = {**chat, "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": SOAK_SCHEMA}}}
        (await _post(client, "/v1/chat/completions", body)).json()
        return "ok"
    if kind == "bad_request":
        response = await client.post("/v1/chat/completions", json={**chat, "temperature": -1})
        assert response.status_code == 400, response.text
        return "rejected"
    if kind == "completion_disconnect":
        body = {"model": model, "prompt": prompt, "max_tokens": 64, "ignore_eos": True}
        try:
            await asyncio.wait_for(client.post("/v1/completions", json=body), 0.02)
        except asyncio.TimeoutError:
            return "disconnected"
        return "ok"
    # chat_stream, chat_stream_disconnect
    body = {**chat, "max_tokens": 16, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise AssertionError(f"{response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            json.loads(line[6:])
            chunks += 1
            if kind == "chat_stream_disconnect" and chunks == 2:
                return "disconnected"  # leaving the block closes the connection
    return "ok"


async def _post(client: Any, path: str, body: dict[str, Any]) -> Any:
    response = await client.post(path, json=body)
    if response.status_code != 200:
        raise AssertionError(f"{path}: {response.status_code}: {response.text}")
    return response


async def _soak(url: str, model: str, num_requests: int, concurrency: int,
                sample_every: int, processes: dict[str, int], headers: dict[str, str],
                seed: int, on_sample: Callable[[int, dict[str, int]], None] | None) -> SoakResult:
    import httpx

    result = SoakResult()
    rng = random.Random(seed)
    next_index = 0
    done = 0

    def sample() -> None:
        rss = {name: rss_bytes(pid) for name, pid in processes.items()}
        result.samples.append((done, rss))
        if on_sample is not None:
            on_sample(done, rss)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index, done
        while next_index < num_requests:
            index, next_index = next_index, next_index + 1
            kind = REQUEST_KINDS[index % len(REQUEST_KINDS)]
            result.outcomes[(kind, await _one(client, model, kind, rng))] += 1
            done += 1
            if done % sample_every == 0:
                sample()

    sample()
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120,
                                 limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    if done % sample_every:
        sample()
    return result


def run_soak(url: str, model: str, num_requests: int, *, processes: dict[str, int],
             concurrency: int = 8, sample_every: int = 100,
             headers: dict[str, str] | None = None, seed: int = 0,
             on_sample: Callable[[int, dict[str, int]], None] | None = None) -> SoakResult:
    """Sends `num_requests` requests of the fixed mix, `concurrency` at a time, to the server
    at `url`; samples the RSS of `processes` (name -> pid) before the first request and every
    `sample_every` requests (and at the end)."""
    return asyncio.run(_soak(url, model, num_requests, concurrency, sample_every, processes,
                             headers or {}, seed, on_sample))
