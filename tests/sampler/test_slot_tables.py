"""Per-slot lists and bitmasks: bit layout, lazy allocation, widening without losing rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.sampler.slot_tables import (SlotBitmasks, SlotLists, num_words, pack_token_bits,
                                      unpack_token_bits)

CPU = torch.device("cpu")


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_pack_unpack_round_trip(vocab: int) -> None:
    g = np.random.default_rng(vocab)
    ids = g.choice(vocab, size=min(vocab, 40), replace=False)
    words = pack_token_bits(list(ids) + [vocab, vocab + 40, -1], vocab)  # extras dropped
    assert words.dtype == np.int32 and words.shape == (num_words(vocab),)
    bits = unpack_token_bits(torch.from_numpy(words).unsqueeze(0), vocab)[0]
    assert bits.shape == (vocab,)
    assert sorted(bits.nonzero().flatten().tolist()) == sorted(ids.tolist())


def test_bit_31_uses_the_sign_bit() -> None:
    words = pack_token_bits([31, 63], 64)
    assert words.tolist() == [-(2**31), -(2**31)]
    assert unpack_token_bits(torch.from_numpy(words)[None], 64)[0].nonzero().flatten().tolist() \
        == [31, 63]


def test_bitmasks_allocate_on_first_set() -> None:
    masks = SlotBitmasks(4, 100, CPU)
    assert masks.words is None
    masks.apply()  # nothing staged, nothing allocated
    masks.set(2, [0, 99, 50])
    masks.apply()
    assert masks.words.shape == (4, 4)
    assert unpack_token_bits(masks.words, 100).nonzero().tolist() == [[2, 0], [2, 50], [2, 99]]
    masks.set(2, [1])  # a new request in the slot replaces the whole row
    masks.apply()
    assert unpack_token_bits(masks.words, 100).nonzero().tolist() == [[2, 1]]


def test_lists_widen_and_keep_earlier_rows() -> None:
    lists = SlotLists(3, CPU, with_values=True, max_width=100, min_width=4)
    assert lists.ids is None
    lists.set(0, [5, 6], [0.5, 0.25])
    lists.set(1, [], [])
    lists.apply()
    assert lists.width == 4 and lists.lengths.tensor.tolist() == [2, 0, 0]
    lists.set(2, [1, 2, 3], [1.0, 2.0, 3.0])  # staged, not applied, when the table widens
    lists.set(1, list(range(9)), [0.0] * 9)
    lists.apply()
    assert lists.width == 16
    assert lists.ids[0, :2].tolist() == [5, 6] and lists.values[0, :2].tolist() == [0.5, 0.25]
    assert lists.ids[2, :3].tolist() == [1, 2, 3]
    assert lists.ids[1, :9].tolist() == list(range(9))
    assert lists.lengths.tensor.tolist() == [2, 9, 3]
    lists.set(1, list(range(70)), [1.0] * 70)
    lists.apply()
    assert lists.width == 100  # capped at max_width
    with pytest.raises(ValueError, match="exceeds"):
        lists.set(0, list(range(101)), [0.0] * 101)
