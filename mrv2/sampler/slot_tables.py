"""Per-slot sampler tables that are allocated only when a request first needs them.

Two shapes serve every optional sampling feature:

- ``SlotLists``: a short list per slot (logit-bias token ids and values, min_tokens stop ids):
  an int32 ``[num_slots, width]`` id table, optionally a float32 value table beside it, and an
  always-allocated int32 ``lengths[num_slots]``. The wide tables are allocated on the first
  non-empty list and widened (powers of two, up to ``max_width``) when a longer list arrives.
- ``SlotBitmasks``: one bit per vocabulary token per slot (allowed_token_ids, the prompt's
  tokens for the repetition penalty): int32 ``[num_slots, ceil(vocab / 32)]``, token ``t`` at
  bit ``t & 31`` of word ``t >> 5``; allocated on first use.

Every write is staged on the host and applied with one launch per tensor (DESIGN.md
invariant 3): a list or a bitmask row is one staged run.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mrv2.state.staged import StagedWriteTensor

BITS_PER_WORD = 32


def num_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def pack_token_bits(token_ids, vocab_size: int) -> np.ndarray:
    """The bitmask row (int32 words) with the bits of ``token_ids`` set; ids >= vocab dropped."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    words = np.zeros(num_words(vocab_size), dtype=np.uint32)
    np.bitwise_or.at(words, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    return words.view(np.int32)


_SHIFTS: dict[torch.device, Tensor] = {}


def unpack_token_bits(words: Tensor, vocab_size: int) -> Tensor:
    """``[rows, num_words]`` int32 bitmask rows -> ``[rows, vocab_size]`` bool."""
    shifts = _SHIFTS.get(words.device)
    if shifts is None:
        shifts = _SHIFTS[words.device] = torch.arange(BITS_PER_WORD, dtype=torch.int32,
                                                       device=words.device)
    bits = (words.unsqueeze(-1) >> shifts).bitwise_and_(1)  # arithmetic shift; & 1 is exact
    return bits.view(words.shape[0], -1)[:, :vocab_size].bool()


class SlotLists:
    def __init__(self, num_slots: int, device: torch.device, *, with_values: bool,
                 max_width: int | None = None, min_width: int = 16) -> None:
        self.num_slots = num_slots
        self.device = device
        self.with_values = with_values
        self.max_width = max_width
        self.min_width = min_width
        self.lengths = StagedWriteTensor(torch.zeros(num_slots, dtype=torch.int32,
                                                     device=device))
        self.width = 0
        self._ids: StagedWriteTensor | None = None
        self._values: StagedWriteTensor | None = None

    @property
    def ids(self) -> Tensor | None:
        """int32 ``[num_slots, width]``; None until a slot holds a non-empty list."""
        return None if self._ids is None else self._ids.tensor

    @property
    def values(self) -> Tensor | None:
        return None if self._values is None else self._values.tensor

    def set(self, slot: int, ids, values=None) -> None:
        """Stage the slot's list (empty clears it); rows past ``len(ids)`` are never read."""
        n = len(ids)
        if self.max_width is not None and n > self.max_width:
            raise ValueError(f"a list of {n} entries exceeds the table width {self.max_width}")
        self.lengths.stage_set(slot, n)
        if n == 0:
            return
        if n > self.width:
            self._grow(n)
        assert self._ids is not None
        self._ids.stage_write(slot, 0, np.asarray(ids, dtype=np.int32))
        if self.with_values:
            assert self._values is not None and values is not None
            self._values.stage_write(slot, 0, np.asarray(values, dtype=np.float32))

    def _grow(self, needed: int) -> None:
        width = max(self.min_width, 1 << (needed - 1).bit_length())
        if self.max_width is not None:
            width = min(width, self.max_width)

        def widen(old: StagedWriteTensor | None, dtype: torch.dtype) -> StagedWriteTensor:
            table = torch.zeros(self.num_slots, width, dtype=dtype, device=self.device)
            if old is not None:
                old.apply()  # staged rows land in the old table before it is copied
                table[:, :self.width] = old.tensor
            return StagedWriteTensor(table)

        self._ids = widen(self._ids, torch.int32)
        if self.with_values:
            self._values = widen(self._values, torch.float32)
        self.width = width

    def apply(self) -> None:
        self.lengths.apply()
        if self._ids is not None:
            self._ids.apply()
        if self._values is not None:
            self._values.apply()


class SlotBitmasks:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self._words: StagedWriteTensor | None = None

    @property
    def words(self) -> Tensor | None:
        """int32 ``[num_slots, ceil(vocab / 32)]``; None until first set."""
        return None if self._words is None else self._words.tensor

    def set(self, slot: int, token_ids) -> None:
        if self._words is None:
            self._words = StagedWriteTensor(torch.zeros(
                self.num_slots, num_words(self.vocab_size), dtype=torch.int32,
                device=self.device))
        self._words.stage_write(slot, 0, pack_token_bits(token_ids, self.vocab_size))

    def apply(self) -> None:
        if self._words is not None:
            self._words.apply()
