"""greedy_numba's argmax against torch.argmax with NaN read as -inf (the Triton twin's and the
torch fallback's semantics), on the cases its integer keys could get wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.sampler import greedy_numba
from mrv2.sampler.greedy_numba import _RUN


def _reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nan = logits.isnan()
    return logits.masked_fill(nan, float("-inf")).argmax(dim=-1), nan.any(dim=-1)


def _check(logits: torch.Tensor) -> None:
    sampled, nan_rows = greedy_numba.greedy_argmax_float32(logits)
    expected, expected_nan = _reference(logits)
    assert sampled.dtype == torch.int64 and nan_rows.dtype == torch.bool
    assert torch.equal(sampled, expected)
    assert torch.equal(nan_rows, expected_nan)
    # Both kernels, whichever the row count picks (the serial one up to MAX_SERIAL_ROWS).
    for kernel in (greedy_numba.greedy_argmax_kernel, greedy_numba.greedy_argmax_serial):
        got, got_nan = np.empty(len(logits), np.int64), np.empty(len(logits), np.bool_)
        kernel(logits.contiguous().numpy().view(np.int32), got, got_nan)
        assert np.array_equal(got, expected.numpy()) and np.array_equal(got_nan,
                                                                        expected_nan.numpy())


@pytest.mark.parametrize("vocab", [1, 7, _RUN - 1, _RUN, _RUN + 1, 3 * _RUN + 5, 49_152])
def test_random_rows(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    _check(torch.randn(5, vocab, generator=g) * 10)


def test_ties_go_to_the_lowest_index_across_runs() -> None:
    logits = torch.zeros(3, 4 * _RUN)
    logits[0, [_RUN + 3, 3 * _RUN]] = 5.0          # two runs reach the max: the first wins
    logits[1, [2 * _RUN + 9, 2 * _RUN + 1]] = 5.0  # two in one run
    logits[2] = 1.0                                 # a flat row: index 0
    _check(logits)
    assert greedy_numba.greedy_argmax_float32(logits)[0].tolist() == [_RUN + 3, 2 * _RUN + 1, 0]


def test_nan_is_minus_infinity() -> None:
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [nan, 1.0, 3.0, nan, 2.0],     # NaN first: the max still wins
        [nan, nan, nan, nan, nan],     # all NaN: token 0
        [-inf, nan, -inf, -inf, -inf],  # NaN and -inf only: token 0
        [-inf, -inf, -inf, -inf, -inf],
        [1.0, inf, nan, inf, -inf],    # +inf wins, the first of two
        [-3.0, -1.0, -2.0, -1.0, -5.0],  # all negative: the larger, first
    ])
    _check(logits)
    sampled, nan_rows = greedy_numba.greedy_argmax_float32(logits)
    assert sampled.tolist() == [2, 0, 0, 0, 1, 1]
    assert nan_rows.tolist() == [True, True, True, False, True, False]


def test_negative_zero_equals_zero_and_subnormals_order() -> None:
    tiny = torch.finfo(torch.float32).smallest_normal / 8  # a subnormal
    logits = torch.tensor([
        [-1.0, -0.0, -2.0, 0.0, -0.5],  # -0.0 == 0.0: the first
        [-1.0, 0.0, -2.0, -0.0, -0.5],
        [0.0, -tiny, tiny, -0.0, 0.0],  # a positive subnormal beats zero
        [-tiny, -0.0, -2 * tiny, -1.0, -tiny],
    ])
    _check(logits)
    assert greedy_numba.greedy_argmax_float32(logits)[0].tolist() == [1, 1, 2, 1]


def test_every_nan_payload_and_sign_reads_as_nan() -> None:
    bits = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000, -0x00000001, 0x7FFFFFFF],
                        dtype=torch.int32)  # quiet, signalling, negative quiet, all ones
    logits = torch.full((5, 9), -4.0)
    for row, pattern in enumerate(bits):
        logits[row].view(torch.int32)[row] = pattern
        logits[row, 8] = -3.0
    assert logits.isnan().sum().item() == 5
    _check(logits)
    assert greedy_numba.greedy_argmax_float32(logits)[0].tolist() == [8] * 5


def test_no_rows() -> None:
    sampled, nan_rows = greedy_numba.greedy_argmax_float32(torch.empty(0, 10))
    assert sampled.shape == (0,) and nan_rows.shape == (0,)


def test_takes_logits() -> None:
    assert greedy_numba.takes_logits(torch.zeros(2, 4))
    assert not greedy_numba.takes_logits(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert not greedy_numba.takes_logits(torch.zeros(4, 2).t())
    assert not greedy_numba.takes_logits(torch.zeros(2, 0))
    assert not greedy_numba.takes_logits(torch.zeros(8))


def test_the_torch_fallback_agrees() -> None:
    """sampler_torch's fallback (other dtypes, other devices) gives the kernel's results."""
    from mrv2.sampler.sampler_torch import greedy_argmax_torch

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 3 * _RUN + 1, generator=g)
    logits[1, 5] = float("nan")
    logits[2] = float("nan")
    logits[3, [7, 900]] = 9.0
    for got, want in zip(greedy_argmax_torch(logits), greedy_numba.greedy_argmax_float32(logits)):
        assert torch.equal(got, want)
