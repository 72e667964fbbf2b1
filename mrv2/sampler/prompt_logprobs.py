"""Prompt logprobs on the runner side: which requests still need them, and computing them
for the prompt positions a step runs.

Prompt position ``p`` (``0 <= p < prompt_len - 1``) predicts prompt token ``p + 1``: its row is
that token's logprob and rank plus the position's top-k (raw logprobs, whatever the
``logprobs_mode``, as vLLM). The last prompt position predicts the first output token, which the
sampler's logprobs cover.

Invariants:
- Only requests that asked (``SamplingParams.prompt_logprobs`` set) and whose prompt rows are not
  all computed yet are tracked. With none tracked the runner never calls ``compute``: a batch
  without prompt logprobs does no extra work.
- A request is tracked from ``add`` until the step that computes its last prompt row, or until
  it finishes or is preempted. A request resumed after it sampled (prefill longer than the
  prompt) is not tracked again: its prompt logprobs were delivered before the preemption.
- Logits are computed ``chunk_size`` rows at a time (logprobs.prompt_logprobs), so a long
  prompt never holds more than ``[chunk_size, vocab]`` logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from mrv2.sampler.logprobs import LogprobsTensors, prompt_logprobs
from mrv2.state.host_staging import upload_array

# Logit elements per chunk (64 MiB of float32): 512 rows of a 32k vocabulary.
CHUNK_ELEMS = 1 << 24


@dataclass
class _Tracked:
    prompt: np.ndarray  # int64 prompt token ids
    num_logprobs: int  # top-k per row


class PromptLogprobsState:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.chunk_size = max(1, CHUNK_ELEMS // max(vocab_size, 1))
        self.tracked: dict[str, _Tracked] = {}

    def __bool__(self) -> bool:
        """Some request still needs prompt rows: only then does the runner call compute."""
        return bool(self.tracked)

    def add(self, req_id: str, prompt_token_ids: list[int], prefill_len: int,
            num_logprobs: int | None) -> None:
        """Track a new (or resumed) request if it asked for prompt logprobs and has prompt rows
        left (see the module invariants)."""
        if num_logprobs is None or len(prompt_token_ids) < 2:
            return
        if prefill_len > len(prompt_token_ids):
            return  # resumed after sampling: delivered before the preemption
        self.tracked[req_id] = _Tracked(np.asarray(prompt_token_ids, dtype=np.int64),
                                        num_logprobs)

    def finish(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)

    def compute(self, req_ids: list[str], starts: np.ndarray, num_scheduled: np.ndarray,
                query_start_loc: np.ndarray, hidden_states: Tensor,
                compute_logits: Callable[[Tensor], Tensor]
                ) -> dict[str, tuple[int, LogprobsTensors]]:
        """Prompt rows this step computes, per tracked request of the batch:
        ``req_id -> (first prompt position, rows)``.

        Per batch row: ``starts`` the number of tokens computed before this step,
        ``num_scheduled`` the tokens of this step, ``query_start_loc`` where they sit in
        ``hidden_states``. The loop runs over the tracked requests only.
        """
        out: dict[str, tuple[int, LogprobsTensors]] = {}
        tracked = self.tracked
        rows = [(row, req_id) for row, req_id in enumerate(req_ids) if req_id in tracked]
        for row, req_id in rows:
            entry = tracked[req_id]
            num_rows = len(entry.prompt) - 1  # positions that predict a prompt token
            start = int(starts[row])
            end = min(start + int(num_scheduled[row]), num_rows)
            if end >= num_rows:
                del tracked[req_id]  # its last prompt row is computed now
            if start >= end:
                continue
            first = int(query_start_loc[row])
            next_ids = upload_array(entry.prompt[start + 1:end + 1], self.device)
            out[req_id] = (start, prompt_logprobs(
                hidden_states[first:first + end - start], compute_logits, next_ids,
                entry.num_logprobs, chunk_size=self.chunk_size))
        return out
