"""Logprobs of the sampled token (with its rank) and of the top-k tokens, without a
``[batch, vocab]`` log-softmax: one logsumexp per row, then gathers.

    logprob(token) = logit(token) - logsumexp(row)
    rank(token)    = #tokens whose logit >= logit(token)    (1 = the most likely; vLLM's rank)

Modes (vLLM's ``logprobs_mode``): ``raw_*`` read the model's logits before any processing,
``processed_*`` read the logits the row was sampled from (after bias, allowed ids, min_tokens,
penalties, temperature, min-p, top-k and top-p; filtered tokens are ``-inf``). ``*_logits``
return the logit values themselves instead of logprobs.

On the torch path the sampler calls ``compute_logprobs`` per row tile, so every intermediate is
tile-sized; the Triton path computes logsumexp, the sampled value and its rank in one pass per
row (logprobs_triton.py) and the top-k with ``torch.topk``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from mrv2 import batch_invariant

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class LogprobsTensors:
    """Per batch row: column 0 is the sampled token, columns 1..k the top-k (k = the largest
    number of logprobs a row of the batch asked for; rows that asked for fewer are trimmed by
    ``to_lists``)."""

    token_ids: Tensor  # [B, 1 + k] int64
    logprobs: Tensor  # [B, 1 + k] float32
    ranks: Tensor  # [B] int64: rank of the sampled token

    def to_lists(self, num_logprobs: np.ndarray) -> list[tuple[list[int], list[float], int] | None]:
        """Host lists per row: ``(token_ids, logprobs, rank)`` with ``1 + num_logprobs[row]``
        entries (sampled token first), or None for a row that asked for none (-1). Call on
        host tensors."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        out: list[tuple[list[int], list[float], int] | None] = []
        for row, n in enumerate(np.asarray(num_logprobs).tolist()):
            out.append(None if n < 0 else (ids[row][:n + 1], lps[row][:n + 1], ranks[row]))
        return out


def compute_logprobs(source: Tensor, sampled: Tensor, num_topk: int, *,
                     as_logits: bool = False) -> LogprobsTensors:
    """Logprobs of ``sampled`` and the top ``num_topk`` tokens of each row of ``source``.

    ``source``: ``[rows, vocab]`` logits (any float dtype; computed in float32).
    Temporaries are ``[rows, vocab]``: the sampler passes row tiles.
    """
    x = source if source.dtype == torch.float32 else source.float()
    chosen = x.gather(1, sampled.long().unsqueeze(1))
    ranks = (x >= chosen).sum(dim=-1)
    if num_topk > 0:
        top_values, top_ids = x.topk(num_topk, dim=-1)
        values = torch.cat([chosen, top_values], dim=1)
        ids = torch.cat([sampled.long().unsqueeze(1), top_ids], dim=1)
    else:
        values, ids = chosen.clone(), sampled.long().unsqueeze(1)
    if not as_logits:
        if batch_invariant.active() and x.device.type == "cpu":
            from mrv2.sampler import logprobs_numba  # numba loads with the CPU path only

            values = values - logprobs_numba.logsumexp(x)
        else:
            values = values - torch.logsumexp(x, dim=-1, keepdim=True)
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)


def prompt_logprobs(hidden_states: Tensor, compute_logits: Callable[[Tensor], Tensor],
                    next_token_ids: Tensor, num_topk: int, *,
                    chunk_size: int = 512) -> LogprobsTensors:
    """Prompt logprobs in chunks of positions, so a long prompt never holds more than
    ``[chunk_size, vocab]`` logits at once.

    ``hidden_states[i]`` is the hidden state of prompt position i and ``next_token_ids[i]``
    the prompt token at position i + 1; row i of the result is that token's logprob and rank
    plus the top ``num_topk`` at position i (raw logits: prompt logprobs are never processed).
    """
    n = hidden_states.shape[0]
    if next_token_ids.shape[0] != n:
        raise ValueError(f"{n} hidden states but {next_token_ids.shape[0]} next tokens")
    parts = [compute_logprobs(compute_logits(hidden_states[s:s + chunk_size]),
                              next_token_ids[s:s + chunk_size], num_topk)
             for s in range(0, n, chunk_size)]
    if not parts:
        empty = hidden_states.new_empty((0, 1 + num_topk), dtype=torch.float32)
        return LogprobsTensors(empty.long(), empty, empty.new_empty(0, dtype=torch.int64))
    return LogprobsTensors(torch.cat([p.token_ids for p in parts]),
                           torch.cat([p.logprobs for p in parts]),
                           torch.cat([p.ranks for p in parts]))
