"""Beam search in the front end, over `LLM.generate` (vLLM's `LLM.beam_search`).

Every step, each live beam of each prompt is sent as a prompt of its own (its token ids) with
`max_tokens=1` and `logprobs=2 * beam_width`: its candidates are the tokens of that step's
logprobs dict (the top 2 * beam_width, plus the sampled token where it is not among them), each
scored by the beam's cumulative logprob plus the token's. A candidate ending in the EOS token
(unless `ignore_eos`) is finished and kept aside; the best `beam_width` of the others, by
`get_beam_search_score`, live on. After `max_tokens` steps (or when no beam is left) the
finished and the live beams are ranked by that score and the best `beam_width` returned, best
first. Prefix caching makes the repeated prompts cheap: only the new token of a beam is computed.

As in vLLM: the logprobs are the engine's (raw, by default: `temperature` only changes which
token is sampled, and so at most one extra candidate a beam); the score's length counts the
prompt too; a sequence's `text` is the decode of all its tokens, prompt and EOS included.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from mrv2.outputs import Logprob
from mrv2.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from mrv2.entrypoints.llm import LLM


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): `tokens` holds the prompt and then the generated tokens, `logprobs`
    one logprobs dict (the step's candidates) per generated token. `text` is filled when the
    sequence is returned. `finish_reason`: "stop" (it ended with EOS) or "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt (at most beam_width), best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's (after transformers'): `cumulative_logprob / length ** length_penalty`, where the
    length counts every token (prompt included) but a final EOS."""
    length = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cumulative_logprob / (length ** length_penalty)


def run_beam_search(llm: LLM, prompts: Any, params: BeamSearchParams, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """`LLM.beam_search`'s body (see the module docstring)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
    params.validate()
    engine = llm.llm_engine
    if 2 * params.beam_width > engine.max_logprobs:
        _invalid("beam_width", params.beam_width,
                 f"must be at most {engine.max_logprobs // 2}: each step asks for 2 * beam_width "
                 f"logprobs, and max_logprobs is {engine.max_logprobs}")
    if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(
            concurrency_limit, int) or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit={concurrency_limit!r} is invalid: must be None or "
                         f"an integer of at least 1")
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    # The engine's own tokenization of text prompts (and its errors), before any work.
    instances = [[BeamSearchSequence(tokens=engine.input_processor._tokenize(p)[1])]
                 for p in prompts]
    search = _Search(llm, params)
    limit = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), limit):
        search.run(instances[start:start + limit], use_tqdm)
    return [search.best(i) for i in range(len(instances))]


class _Search:
    def __init__(self, llm: LLM, params: BeamSearchParams) -> None:
        self.llm = llm
        self.params = params
        self.eos = llm.llm_engine.input_processor.eos_token_id
        self.max_model_len = llm.llm_engine.config.model_config.max_model_len
        self.step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1,
                                          temperature=params.temperature)
        self.completed: dict[int, list[BeamSearchSequence]] = {}
        self.live: dict[int, list[BeamSearchSequence]] = {}
        self.offset = 0  # index of the current batch's first prompt

    def score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos,
                                     self.params.length_penalty)

    def run(self, batch: list[list[BeamSearchSequence]], use_tqdm: bool) -> None:
        indices = range(self.offset, self.offset + len(batch))
        self.offset += len(batch)
        for i, beams in zip(indices, batch):
            self.live[i], self.completed[i] = beams, []
        steps = tqdm(range(self.params.max_tokens), desc="Beam search", unit="token",
                     disable=not use_tqdm)
        for _ in steps:
            for i in indices:  # a beam at max_model_len can grow no further: finished
                for beam in self.live[i]:
                    if len(beam.tokens) >= self.max_model_len:
                        beam.finish_reason = "length"
                        self.completed[i].append(beam)
                self.live[i] = [b for b in self.live[i] if len(b.tokens) < self.max_model_len]
            order = [(i, beam) for i in indices for beam in self.live[i]]
            if not order:
                break
            outputs = self.llm.generate([{"prompt_token_ids": b.tokens} for _, b in order],
                                        self.step_params, use_tqdm=False)
            candidates: dict[int, list[BeamSearchSequence]] = {i: [] for i in indices}
            for (i, beam), output in zip(order, outputs):
                candidates[i] += self._expand(i, beam, output.outputs[0].logprobs)
            for i in indices:
                ranked = sorted(candidates[i], key=self.score, reverse=True)
                self.live[i] = ranked[:self.params.beam_width]
        steps.close()

    def _expand(self, i: int, beam: BeamSearchSequence, logprobs) -> list[BeamSearchSequence]:
        """The beam's live candidates; its EOS candidate goes to `completed`."""
        if not logprobs:  # no token came back: nothing to extend
            return []
        step = logprobs[0]
        new = []
        for token, entry in step.items():
            child = BeamSearchSequence(tokens=beam.tokens + [token],
                                       logprobs=beam.logprobs + [step],
                                       cum_logprob=beam.cum_logprob + entry.logprob)
            if token == self.eos and not self.params.ignore_eos:
                child.finish_reason = "stop"
                self.completed[i].append(child)
            else:
                new.append(child)
        return new

    def best(self, i: int) -> BeamSearchOutput:
        tokenizer = self.llm.get_tokenizer()
        for beam in self.live.pop(i):
            self.completed[i].append(beam)
            beam.finish_reason = beam.finish_reason or "length"
        ranked = sorted(self.completed.pop(i), key=self.score, reverse=True)
        best = ranked[:self.params.beam_width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        return BeamSearchOutput(sequences=best)


def _invalid(name: str, value: object, why: str) -> None:
    raise ValueError(f"BeamSearchParams.{name}={value!r} is invalid: {why}")


__all__ = ["BeamSearchOutput", "BeamSearchSequence", "get_beam_search_score", "run_beam_search"]
