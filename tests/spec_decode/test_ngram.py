"""The n-gram draft proposer: hand-checked cases on both twins, and the numba twin against the
torch reference on random small-vocabulary histories (where repeats, hence matches, abound)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.spec_decode import ngram_numba
from mrv2.spec_decode.ngram import propose_ngram


def _run_torch(token_ids, slots, total_len, min_n, max_n, max_drafts, k):
    drafts = torch.full((len(slots), k), -7, dtype=torch.int32)  # -7: must be overwritten
    num = torch.full((len(slots),), -7, dtype=torch.int32)
    propose_ngram(torch.as_tensor(token_ids, dtype=torch.int32),
                  torch.as_tensor(slots, dtype=torch.int64),
                  torch.as_tensor(total_len, dtype=torch.int32), min_n, max_n,
                  torch.as_tensor(max_drafts, dtype=torch.int32), drafts, num)
    return drafts.numpy(), num.numpy()


def _run_numba(token_ids, slots, total_len, min_n, max_n, max_drafts, k):
    drafts = np.full((len(slots), k), -7, dtype=np.int32)
    num = np.full((len(slots),), -7, dtype=np.int32)
    ngram_numba.propose_ngram(np.asarray(token_ids, np.int32), np.asarray(slots, np.int64),
                              np.asarray(total_len, np.int32), min_n, max_n,
                              np.asarray(max_drafts, np.int32), drafts, num)
    return drafts, num


def _one(context, min_n, max_n, k, max_drafts=None, seq=16):
    """Both twins on one row holding `context` (padded with junk to `seq`); they must agree."""
    hist = np.full((1, seq), 9, np.int32)
    hist[0, :len(context)] = context
    args = (hist, [0], [len(context)], min_n, max_n, [k if max_drafts is None else max_drafts], k)
    d_t, n_t = _run_torch(*args)
    d_n, n_n = _run_numba(*args)
    np.testing.assert_array_equal(d_t, d_n)
    np.testing.assert_array_equal(n_t, n_n)
    return d_t[0, :n_t[0]].tolist(), d_t[0, n_t[0]:].tolist()


@pytest.mark.parametrize("context, min_n, max_n, k, max_drafts, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 4, None, [4, 1, 2, 3]),
    # [1, 2] occurs at 0 (-> 5) and 3 (-> 6): the latest occurrence wins.
    ([1, 2, 5, 1, 2, 6, 7, 1, 2], 1, 2, 2, None, [6, 7]),
    # Longest n first: the 2-gram [3, 1] matches at 2 (-> 8); the 1-gram [1] alone would
    # take its latest occurrence, at 5 (-> 4).
    ([0, 4, 3, 1, 8, 1, 4, 3, 1], 1, 2, 1, None, [8]),
    ([1, 2, 3, 4], 1, 3, 4, None, []),  # no match
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 4, 2, [4, 1]),  # max_drafts caps
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 4, 0, []),  # max_drafts 0
    ([5, 6, 7, 5, 6], 2, 2, 4, None, [7, 5, 6]),  # continuation shorter than K
    ([3, 3], 2, 3, 4, None, []),  # context shorter than min_n + 1
    ([3, 3], 1, 3, 4, None, [3]),  # ... but long enough for n = 1
    ([3], 1, 3, 4, None, []),
    ([], 1, 3, 4, None, []),
    ([1, 2, 1, 3, 1, 2], 3, 5, 4, None, []),  # only n = 1, 2 would match
])
def test_hand_checked(context, min_n, max_n, k, max_drafts, expected):
    got, rest = _one(context, min_n, max_n, k, max_drafts)
    assert got == expected
    assert rest == [0] * (k - len(expected))


def test_full_history_and_rows_sharing_a_slot():
    # total_len == L (nothing past the context to pad with), and two rows on one slot with
    # different caps; a third row on another slot.
    hist = np.array([[1, 2, 3, 1, 2, 3, 1, 2], [4, 4, 4, 4, 0, 0, 0, 0]], np.int32)
    args = (hist, [0, 0, 1], [8, 4], 1, 4, [5, 1, 5], 5)
    d_t, n_t = _run_torch(*args)
    d_n, n_n = _run_numba(*args)
    np.testing.assert_array_equal(d_t, d_n)
    np.testing.assert_array_equal(n_t, n_n)
    assert n_t.tolist() == [3, 1, 1]
    assert d_t.tolist() == [[3, 1, 2, 0, 0], [3, 0, 0, 0, 0], [4, 0, 0, 0, 0]]


def test_numba_matches_torch_on_random_histories():
    rng = np.random.default_rng(0)
    for _ in range(300):
        vocab = int(rng.integers(3, 6))
        slots_n, seq = int(rng.integers(1, 5)), int(rng.integers(1, 24))
        rows = int(rng.integers(0, 7))
        k = int(rng.integers(1, 7))
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        hist = rng.integers(0, vocab, size=(slots_n, seq), dtype=np.int32)
        total_len = rng.integers(0, seq + 1, size=slots_n, dtype=np.int32)
        slots = rng.integers(0, slots_n, size=rows, dtype=np.int64)
        max_drafts = rng.integers(-1, k + 2, size=rows, dtype=np.int32)
        args = (hist, slots, total_len, min_n, max_n, max_drafts, k)
        d_t, n_t = _run_torch(*args)
        d_n, n_n = _run_numba(*args)
        np.testing.assert_array_equal(n_t, n_n, err_msg=repr(args))
        np.testing.assert_array_equal(d_t, d_n, err_msg=repr(args))
        assert ((n_t >= 0) & (n_t <= np.minimum(k, np.maximum(max_drafts, 0)))).all()
