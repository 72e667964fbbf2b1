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


def test_verified_tokens_follow_the_target_distribution():
    """Sampler + verify_drafts over many positions, one draft each: the first token follows
    the first row's distribution (chi-square), the draft is accepted with its probability, and
    a second token (after an accepted draft) follows the second row's distribution."""
    from test_sampler import LOGITS, chi_square_pvalue, reference_probs, sample

    n, draft = 10_000, 2
    second = [v * 0.5 + (i % 3) for i, v in enumerate(LOGITS)]
    logits = torch.tensor([LOGITS, second]).repeat(n, 1)
    sampled = sample(logits, temperature=0.9, seeds=77, positions=torch.arange(2 * n))
    input_ids = torch.tensor([0, draft]).repeat(n)
    accepted, final, _ = verify_drafts(sampled, input_ids, torch.arange(0, 2 * n, 2),
                                       torch.full((n,), 2), torch.zeros(2 * n, dtype=torch.bool))
    first = sampled[0::2]
    p0 = reference_probs(LOGITS, 0.9, 0, 1.0, 0.0)
    assert chi_square_pvalue(torch.bincount(first, minlength=len(LOGITS)), p0) > 1e-3
    rate, expected = accepted.float().mean().item(), p0[draft]
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / n) ** 0.5
    kept_second = sampled[1::2][accepted.bool()]
    p1 = reference_probs(second, 0.9, 0, 1.0, 0.0)
    assert chi_square_pvalue(torch.bincount(kept_second, minlength=len(LOGITS)), p1) > 1e-3
    assert torch.equal(final, torch.arange(0, 2 * n, 2) + accepted)
