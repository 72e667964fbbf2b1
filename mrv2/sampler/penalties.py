"""Repetition, presence and frequency penalties: per-slot token tables and the torch stage.

Semantics (as vLLM):

- repetition (vLLM/CTRL): for every token seen in the prompt or the output so far, a positive
  logit is divided by the penalty and a negative one multiplied by it;
- frequency (OpenAI): ``logit -= frequency_penalty * count``, ``count`` = times the token was
  produced so far (output tokens only);
- presence (OpenAI): ``logit -= presence_penalty`` for every token produced at least once.

In that order, after logit bias (so the repetition penalty sees the biased sign).

Memory: the output counts (int32 ``[num_slots, vocab]``) and the prompt bitmask
(``[num_slots, vocab / 32]``) are allocated when the first request with a penalty is added,
never before. Rows of slots without penalties are never reset and hold garbage; those rows
are only ever combined with neutral parameters (x / 1, x * 1, x - 0 * count), which leave the
logits bit-for-bit unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mrv2.sampler.slot_tables import SlotBitmasks
from mrv2.state.host_staging import upload_array


class PenaltyState:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self.prompt_mask = SlotBitmasks(num_slots, vocab_size, device)
        self.output_counts: Tensor | None = None
        # slot -> output tokens it already produced (a resumed request); the last add wins.
        self._pending: dict[int, np.ndarray] = {}

    @property
    def allocated(self) -> bool:
        return self.output_counts is not None

    def add(self, slot: int, prompt_token_ids, output_token_ids) -> None:
        """A request with a penalty takes ``slot``: stage its prompt set and its counts."""
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.int32,
                                             device=self.device)
        self.prompt_mask.set(slot, prompt_token_ids)
        tokens = np.asarray(output_token_ids, dtype=np.int64).reshape(-1)
        self._pending[slot] = tokens[(tokens >= 0) & (tokens < self.vocab_size)]

    def apply_staged_writes(self) -> None:
        self.prompt_mask.apply()
        if not self._pending:
            return
        counts = self.output_counts
        assert counts is not None
        slots = np.fromiter(self._pending, dtype=np.int64, count=len(self._pending))
        lengths = np.fromiter((len(t) for t in self._pending.values()), dtype=np.int64,
                              count=len(slots))
        tokens = np.concatenate(list(self._pending.values()))
        self._pending.clear()
        counts.index_fill_(0, upload_array(slots, self.device), 0)
        if len(tokens):
            rows = upload_array(np.repeat(slots, lengths), self.device)
            cols = upload_array(tokens, self.device)
            counts.index_put_((rows, cols), torch.ones(len(tokens), dtype=torch.int32,
                                                       device=self.device), accumulate=True)

    def count_sampled(self, idx_mapping: Tensor, sampled: Tensor, did_sample: Tensor) -> None:
        """``counts[slot, sampled] += 1`` for the batch rows that produced a token; device only.
        A slot may repeat (a verify step's kept tokens): the updates accumulate."""
        assert self.output_counts is not None
        self.output_counts.index_put_((idx_mapping.long(), sampled.long()),
                                      did_sample.to(torch.int32), accumulate=True)


def apply_penalties_(x: Tensor, counts: Tensor, in_prompt: Tensor | None,
                     repetition: Tensor | None, presence: Tensor | None,
                     frequency: Tensor | None) -> Tensor:
    """The penalties on a float32 ``[rows, vocab]`` tile, in place.

    ``counts``: int32 ``[rows, vocab]`` output counts; ``in_prompt``: bool ``[rows, vocab]``;
    the penalties are ``[rows]`` float32. ``None`` skips a part: the repetition penalty
    (``in_prompt`` and ``repetition``) or the OpenAI ones (``presence`` and ``frequency``,
    both or neither); skipping is bit-for-bit the same as neutral values (x / 1, x - 0).
    The Triton kernel does the same float operations in the same order (its results agree
    within float tolerance: a GPU may fuse the multiply-subtract into one FMA).
    """
    present = counts > 0
    if repetition is not None:
        assert in_prompt is not None
        rep = repetition.unsqueeze(1)
        penalised = torch.where(x > 0, x / rep, x * rep)
        torch.where(in_prompt.logical_or_(present), penalised, x, out=x)
    if frequency is not None:
        assert presence is not None
        x.sub_(frequency.unsqueeze(1) * counts)
        x.sub_(presence.unsqueeze(1) * present)
    return x
