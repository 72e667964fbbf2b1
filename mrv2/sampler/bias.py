"""Per-slot logit bias, allowed_token_ids and min_tokens stop ids, and their torch stages.

- logit_bias: up to ``MAX_LOGIT_BIAS`` (token, bias) pairs per slot, added to the logits.
- allowed_token_ids: a vocabulary bitmask per slot; every other token gets ``-inf``.
- min_tokens: while a request has produced fewer than ``min_tokens`` outputs, its stop ids
  (EOS unless ``ignore_eos``, plus ``stop_token_ids``) get ``-inf``. The number of outputs so
  far is ``position - prompt_len``, where ``position`` is the position of the token being
  sampled, so no output counter is needed (and a resumed request, whose prefill holds its
  earlier outputs, is counted right).

The wide tables are allocated on first use (slot_tables.py). The torch functions modify a
float32 ``[rows, vocab]`` tile in place and take the rows' table entries already gathered
through the batch-row -> slot mapping; the Triton versions are in bias_triton.py (logit bias,
min_tokens) and penalties_triton.py (allowed_token_ids, fused with the penalties).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mrv2.sampler.slot_tables import SlotBitmasks, SlotLists, unpack_token_bits
from mrv2.sampling_params import MAX_LOGIT_BIAS
from mrv2.state.staged import StagedWriteTensor


class LogitBiasState:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.bias = SlotLists(num_slots, device, with_values=True, max_width=MAX_LOGIT_BIAS)
        self.stop_ids = SlotLists(num_slots, device, with_values=False)
        self.allowed = SlotBitmasks(num_slots, vocab_size, device)
        # 1 where the slot's request restricts its tokens to its allowed bitmask row.
        self.has_allowed = StagedWriteTensor(torch.zeros(num_slots, dtype=torch.int32,
                                                         device=device))

    def add(self, slot: int, logit_bias: dict[int, float] | None,
            allowed_token_ids: list[int] | None, stop_ids: list[int]) -> None:
        """Stage the slot's tables; ``stop_ids`` is empty when min_tokens does not apply."""
        items = [(t, b) for t, b in (logit_bias or {}).items() if 0 <= t < self.vocab_size]
        self.bias.set(slot, [t for t, _ in items], [b for _, b in items])
        self.stop_ids.set(slot, [t for t in stop_ids if 0 <= t < self.vocab_size])
        self.has_allowed.stage_set(slot, int(allowed_token_ids is not None))
        if allowed_token_ids is not None:
            self.allowed.set(slot, allowed_token_ids)

    def apply_staged_writes(self) -> None:
        self.bias.apply()
        self.stop_ids.apply()
        self.allowed.apply()
        self.has_allowed.apply()


def _first_n(lengths: Tensor, width: int) -> Tensor:
    """[rows, width] bool: entry j of a row is one of its first ``lengths[row]``."""
    return torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def apply_allowed_(x: Tensor, words: Tensor, active: Tensor) -> Tensor:
    """Rows with ``active`` keep only the tokens set in their bitmask row ``words``."""
    allowed = unpack_token_bits(words, x.shape[1])
    return x.masked_fill_(~allowed & active.unsqueeze(1), float("-inf"))


def apply_logit_bias_(x: Tensor, ids: Tensor, values: Tensor, lengths: Tensor) -> Tensor:
    """``x[row, ids[row, j]] += values[row, j]`` for ``j < lengths[row]`` (ids are distinct)."""
    valid = _first_n(lengths, ids.shape[1])
    # Entries past a row's length add 0.0 to token 0: x + 0.0 == x.
    return x.scatter_add_(1, ids.long() * valid, values * valid)


def apply_min_tokens_(x: Tensor, ids: Tensor, lengths: Tensor, active: Tensor) -> Tensor:
    """Rows with ``active`` get ``-inf`` at their first ``lengths[row]`` stop ids."""
    valid = _first_n(lengths, ids.shape[1]) & active.unsqueeze(1)
    # amin with +inf leaves a token as it is, so entries that do not apply change nothing
    # whatever token they point at (duplicate indices cannot race).
    src = torch.where(valid, float("-inf"), float("inf"))
    return x.scatter_reduce_(1, ids.long(), src, "amin", include_self=True)
