"""Engine logprobs -> OpenAI's two formats.

The engine gives, per position, a dict {token id: Logprob(logprob, rank, decoded_token)} holding
the sampled (or prompt) token and the top-k; prompt logprobs start with None (the first prompt
token has no logprob).

- Legacy completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, parallel
  lists; `top_logprobs` maps each position's decoded tokens to their logprobs.
- Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}, the top list ordered by logprob, `top_logprobs` long.

-inf (a token the sampler filtered out) is sent as -9999.0, as OpenAI and vLLM do: JSON has
no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

MIN_LOGPROB = -9999.0


def _value(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) or logprob < MIN_LOGPROB else float(logprob)


def token_text(token_id: int, logprob: Any, tokenizer) -> str:
    decoded = getattr(logprob, "decoded_token", None)
    if decoded is not None:
        return decoded
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


class CompletionLogprobs:
    """Builds the legacy format incrementally (a stream sends it chunk by chunk); text offsets
    continue across chunks."""

    def __init__(self, tokenizer, text_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = text_offset

    def build(self, token_ids: Sequence[int],
              steps: Sequence[Mapping[int, Any] | None]) -> dict[str, list]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for token_id, step in zip(token_ids, steps):
            sampled = None if step is None else step.get(token_id)
            token = token_text(token_id, sampled, self.tokenizer)
            tokens.append(token)
            token_logprobs.append(None if sampled is None else _value(sampled.logprob))
            if step is None:
                top_logprobs.append(None)
            else:
                top_logprobs.append({token_text(t, lp, self.tokenizer): _value(lp.logprob)
                                     for t, lp in step.items()})
            text_offset.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": text_offset}


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _value(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], steps: Sequence[Mapping[int, Any] | None],
                  tokenizer, num_top: int) -> dict[str, list]:
    content = []
    for token_id, step in zip(token_ids, steps):
        step = step or {}
        sampled = step.get(token_id)
        entry = _chat_entry(token_text(token_id, sampled, tokenizer),
                            MIN_LOGPROB if sampled is None else sampled.logprob)
        best = sorted(step.items(), key=lambda item: -_value(item[1].logprob))[:num_top]
        entry["top_logprobs"] = [_chat_entry(token_text(t, lp, tokenizer), lp.logprob)
                                 for t, lp in best]
        content.append(entry)
    return {"content": content}
