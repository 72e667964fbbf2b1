"""NaN logits never yield an out-of-vocabulary or NaN-chosen token, and the sampler reports the
rows that held one (SamplerOutput.nan_rows, on the device), on the torch path and on the
Triton path under the interpreter; the Triton kernels run there also after triton was imported
in compiled mode (as a full test run does). Greedy ties, as NaN rows, go to the lowest token."""

from __future__ import annotations

import pytest
import torch
import triton.language  # noqa: F401  (imported outside the interpreter first, on purpose)

from mrv2.sampling_params import SamplingParams
from sampler_harness import make_batch, random_logits

V = 300
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=0.8, top_p=0.9, seed=2),
    SamplingParams(temperature=1.0, top_k=5, seed=3),
]


def _logits() -> torch.Tensor:
    logits = random_logits(len(PARAMS), V, seed=5)
    logits[:, 17] = 50.0  # the clear winner of every clean row
    return logits


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("all_greedy", [False, True])
def test_nan_rows_give_valid_tokens_and_are_reported(triton: bool, all_greedy: bool) -> None:
    params = [SamplingParams(temperature=0.0)] * len(PARAMS) if all_greedy else PARAMS
    logits = _logits()
    clean = make_batch(params, V).sample(logits, triton=triton)
    assert not clean.nan_rows.any()
    dirty = logits.clone()
    dirty[0, 3] = float("nan")  # a NaN below the winner: the token does not change
    dirty[1, 17] = float("nan")  # NaN on the winner: another valid token
    dirty[2, :] = float("nan")  # all NaN: token 0
    out = make_batch(params, V).sample(dirty, triton=triton)
    assert out.nan_rows.tolist() == [True, True, True, False]
    assert out.sampled[0] == 17 and out.sampled[3] == clean.sampled[3]
    assert out.sampled[1] != 17 and 0 <= out.sampled[1] < V
    assert out.sampled[2] == 0


@pytest.mark.parametrize("triton", [False, True])
def test_greedy_nan_row_takes_the_argmax_of_the_rest(triton: bool) -> None:
    logits = torch.tensor([[1.0, float("nan"), 4.0, 4.0, 2.0]] * 2, dtype=torch.bfloat16)
    out = make_batch([SamplingParams(temperature=0.0)] * 2, 5).sample(logits, triton=triton)
    assert out.sampled.tolist() == [2, 2]
    assert out.nan_rows.tolist() == [True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_go_to_the_lowest_token_on_a_wide_vocabulary(dtype) -> None:
    # The all-greedy torch path takes max(dim)'s indices (faster than argmax on the CPU): the
    # first maximum, as argmax, across a vocabulary the reduction splits into many chunks.
    vocab = 49152
    logits = torch.randint(0, 4, (6, vocab), generator=torch.Generator().manual_seed(0))
    logits = logits.to(dtype)
    logits[:, [40000, 7, 30000]] = 9.0  # ties at the maximum, the lowest not first in memory
    logits[3, 5] = 9.0
    out = make_batch([SamplingParams(temperature=0.0)] * 6, vocab).sample(logits)
    assert out.sampled.tolist() == [7, 7, 7, 5, 7, 7]
    assert out.sampled.tolist() == logits.float().argmax(dim=-1).tolist()
