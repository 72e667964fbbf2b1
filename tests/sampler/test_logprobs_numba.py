"""The batch-invariant logsumexp against torch's, on masked and degenerate rows, and the same
bits for a row alone, among others and at 1 thread."""

from __future__ import annotations

import numba
import pytest
import torch

from mrv2.sampler import logprobs_numba


def test_equals_torch_within_float32_rounding():
    x = torch.randn(5, 49152, generator=torch.Generator().manual_seed(0)) * 6
    x[1, ::3] = float("-inf")  # masked tokens contribute nothing
    torch.testing.assert_close(logprobs_numba.logsumexp(x),
                               torch.logsumexp(x, dim=-1, keepdim=True), rtol=2e-7, atol=0)


def test_degenerate_rows_as_torch():
    x = torch.zeros(3, 8)
    x[0] = float("-inf")
    x[1, 2] = float("nan")
    x[2, 5] = float("inf")
    out = logprobs_numba.logsumexp(x)
    ref = torch.logsumexp(x, dim=-1, keepdim=True)
    assert out[0, 0] == float("-inf") and torch.isnan(out[1, 0]) and out[2, 0] == float("inf")
    assert ref[0, 0] == float("-inf") and torch.isnan(ref[1, 0]) and ref[2, 0] == float("inf")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_the_other_rows(threads):
    x = torch.randn(9, 49152, generator=torch.Generator().manual_seed(1)) * 4
    alone = torch.cat([logprobs_numba.logsumexp(x[i:i + 1]) for i in range(9)])
    previous = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for rows in (2, 3, 9):
            assert torch.equal(logprobs_numba.logsumexp(x[:rows]), alone[:rows])
    finally:
        numba.set_num_threads(previous)
