"""Scores of an embedding model (vLLM's `LLM.score`, `/score`, `/rerank` for embedding
models): the cosine similarity of the two sides' embeddings.

The sides pair 1 to 1, 1 to N (the one first input against each second) or N to N (pairwise);
each distinct input is embedded once. A score's `prompt_token_ids` are the first input's, the
tokenizer's pad token (when it has one) and the second's, as vLLM's.
"""

from __future__ import annotations

from typing import Any

import torch

from mrv2.outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput


def score_pairs(num_1: int, num_2: int) -> list[tuple[int, int]]:
    """(index into the first side, index into the second) of each score, in order."""
    if num_1 == 0 or num_2 == 0:
        raise ValueError("score needs at least one input on each side")
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 != num_2:
        raise ValueError(f"Input lengths must be either 1:1, 1:N or N:N; got {num_1}:{num_2}")
    return [(i, i) for i in range(num_1)]


def as_inputs(data: Any) -> list[Any]:
    """One input (a string or a prompt dict) or a list of them, as a list."""
    if isinstance(data, (str, dict)):
        return [data]
    return list(data)


def cosine_score(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


def scoring_outputs(first: list[PoolingRequestOutput], second: list[PoolingRequestOutput],
                    pad_token_id: int | None) -> list[ScoringRequestOutput]:
    """The scores of `first` against `second` (embeddings, paired by `score_pairs`)."""
    padding = [] if pad_token_id is None else [pad_token_id]
    outputs = []
    for i, j in score_pairs(len(first), len(second)):
        a, b = first[i], second[j]
        outputs.append(ScoringRequestOutput(
            request_id=f"{a.request_id}_{b.request_id}",
            outputs=ScoringOutput(cosine_score(a.outputs.data, b.outputs.data)),
            prompt_token_ids=a.prompt_token_ids + padding + b.prompt_token_ids,
            num_cached_tokens=a.num_cached_tokens + b.num_cached_tokens))
    return outputs
