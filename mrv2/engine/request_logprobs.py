"""Front-end logprobs of one completion: the core's per-token `SampledTokenLogprobs` and per-chunk
`PromptLogprobsChunk`s turned into vLLM's user-facing lists of ``{token id: Logprob}``.

Each dict holds the sampled (or actual prompt) token first, then the top-k, in the runner's
order; ranks are the sampled token's own rank, then 1..k (vLLM's ``_make_logprob_dict``: a
sampled token that is also in the top-k keeps its first position and takes the top-k entry).
``decoded_token`` is ``tokenizer.decode([id])`` of that single id, as vLLM does.

Invariants:
- ``len(logprobs) == number of output tokens received``: one dict per token, appended with
  it. The output processor hands the same slice of both lists to the user, so
  ``len(CompletionOutput.logprobs) == len(CompletionOutput.token_ids)`` in every output kind.
- ``prompt_logprobs[0] is None`` and ``prompt_logprobs[p]`` is prompt position ``p``'s entry.
  Chunks arrive in order; rows already held (a prefill recomputed after a preemption) are
  skipped, a gap is an error.
"""

from __future__ import annotations

from collections.abc import Sequence

from mrv2.outputs import Logprob, PromptLogprobs, SampleLogprobs, TokenLogprobs
from mrv2.protocol import PromptLogprobsChunk, SampledTokenLogprobs


class TokenTexts:
    """``tokenizer.decode([id])`` per id, cached (a single id always decodes the same)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_ids: Sequence[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(token_ids)
        cache, out = self._cache, []
        for token_id in token_ids:
            text = cache.get(token_id)
            if text is None:
                text = cache[token_id] = self.tokenizer.decode([token_id]) or ""
            out.append(text)
        return out


def make_logprob_dict(token_ids: Sequence[int], logprobs: Sequence[float], rank: int,
                      texts: Sequence[str | None]) -> TokenLogprobs:
    """One position's dict: entry 0 is the sampled token with ``rank``, then the top-k with
    ranks 1..k (a duplicate key keeps its first position, with the top-k values)."""
    ranks = [rank, *range(1, len(token_ids))]
    return {t: Logprob(logprob=lp, rank=r, decoded_token=text)
            for t, lp, r, text in zip(token_ids, logprobs, ranks, texts)}


class RequestLogprobs:
    """What one completion accumulated. ``logprobs`` / ``cumulative_logprob`` are None unless
    it asked for sample logprobs, ``prompt_logprobs`` None unless it asked for those."""

    def __init__(self, num_logprobs: int | None, num_prompt_logprobs: int | None,
                 texts: TokenTexts) -> None:
        self.texts = texts
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        self.prompt_logprobs: PromptLogprobs | None = (
            None if num_prompt_logprobs is None else [None])
        self._prompt_sent = False  # DELTA: prompt logprobs go out once

    @staticmethod
    def wanted(num_logprobs: int | None, num_prompt_logprobs: int | None) -> bool:
        return num_logprobs is not None or num_prompt_logprobs is not None

    def add_prompt(self, chunk: PromptLogprobsChunk | None) -> None:
        if chunk is None or self.prompt_logprobs is None:
            return
        held = len(self.prompt_logprobs) - 1  # rows 0..held-1 are in
        if chunk.start > held:
            raise RuntimeError(f"prompt logprobs from position {chunk.start}, but only "
                               f"{held} positions were received")
        texts = self.texts
        for i in range(held - chunk.start, chunk.num_rows):
            ids = chunk.token_ids[i]
            self.prompt_logprobs.append(
                make_logprob_dict(ids, chunk.logprobs[i], chunk.ranks[i], texts(ids)))

    def add_sample(self, new_logprobs: list[SampledTokenLogprobs] | None,
                   num_new_tokens: int) -> None:
        """The logprobs of a step's new tokens (one per token)."""
        if self.logprobs is None or (num_new_tokens == 0 and not new_logprobs):
            return
        if new_logprobs is None or len(new_logprobs) != num_new_tokens:
            got = 0 if new_logprobs is None else len(new_logprobs)
            raise RuntimeError(f"{num_new_tokens} new tokens but {got} logprobs entries")
        texts = self.texts
        for entry in new_logprobs:
            self.logprobs.append(make_logprob_dict(entry.token_ids, entry.logprobs,
                                                   entry.rank, texts(entry.token_ids)))
            self.cumulative_logprob += entry.logprobs[0]

    def sample_out(self, delta: bool, num_new_tokens: int) -> SampleLogprobs | None:
        """The entries of the tokens an output carries: the new ones (DELTA) or all."""
        if self.logprobs is None:
            return None
        if delta:
            return self.logprobs[len(self.logprobs) - num_new_tokens:]
        return list(self.logprobs)

    def prompt_out(self, delta: bool) -> PromptLogprobs | None:
        """Prompt logprobs for a RequestOutput: every time, or (DELTA) in the first only."""
        if self.prompt_logprobs is None or (delta and self._prompt_sent):
            return None
        self._prompt_sent = True
        return self.prompt_logprobs
