"""verify_drafts: the torch twin and the numba twin against hand-worked cases and each other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.sampler import rejection_numba
from mrv2.sampler.rejection import verify_drafts


def both(sampled, input_ids, first_row, num_rows, nan_rows):
    args = [np.asarray(a) for a in (sampled, input_ids, first_row, num_rows, nan_rows)]
    args[0], args[2] = args[0].astype(np.int64), args[2].astype(np.int64)
    args[4] = args[4].astype(np.bool_)
    ref = verify_drafts(*(torch.from_numpy(a) for a in args))
    fast = rejection_numba.verify_drafts(*args)
    for r, f in zip(ref, fast):
        np.testing.assert_array_equal(r.numpy(), f)
    return [f.tolist() for f in fast]


def test_hand_worked():
    # request 0: last token 5, drafts 6 7 8; the target samples 6 7 9 4 -> 2 drafts kept.
    # request 1: a plain decode row (no drafts).
    # request 2: drafts 3 3; the target samples 1 at the first -> nothing kept.
    input_ids = [5, 6, 7, 8, 11, 2, 3, 3]
    sampled = [6, 7, 9, 4, 12, 1, 3, 0]
    accepted, final, nan = both(sampled, input_ids, [0, 4, 5], [4, 1, 3], [False] * 8)
    assert accepted == [2, 0, 0] and final == [2, 4, 5] and nan == [False] * 3


def test_all_accepted_gives_the_bonus_row():
    accepted, final, _ = both([2, 3, 4], [1, 2, 3], [0], [3], [False] * 3)
    assert accepted == [2] and final == [2]


def test_nan_counts_only_kept_rows():
    # The NaN is in a row past the first rejection: its token is never kept.
    _, _, nan = both([6, 9, 4, 1], [5, 6, 7, 8], [0], [4], [False, False, True, False])
    assert nan == [False]
    _, _, nan = both([6, 9, 4, 1], [5, 6, 7, 8], [0], [4], [False, True, False, False])
    assert nan == [True]


@pytest.mark.parametrize("seed", range(3))
def test_random_twins_agree(seed):
    rng = np.random.default_rng(seed)
    num_rows = rng.integers(1, 6, size=rng.integers(1, 20))
    first_row = np.concatenate([[0], np.cumsum(num_rows)[:-1]])
    total = int(num_rows.sum())
    input_ids = rng.integers(0, 3, size=total)
    sampled = rng.integers(0, 3, size=total)
    both(sampled, input_ids, first_row, num_rows, rng.random(total) < 0.05)
