"""AsyncOutput: rows that finished their prefill report their token, others report none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.async_output import AsyncOutput
from mrv2.sampler.logprobs import LogprobsTensors


def test_cpu_output_reads_the_sampled_tensor():
    sampled = torch.tensor([5, 7, 9])
    out = AsyncOutput(["a", "b", "c"], sampled, np.array([True, False, True]))
    result = out.get_output()
    assert result.req_ids == ["a", "b", "c"]
    assert result.sampled_token_ids == [[5], [], [9]]


def test_a_run_of_decode_steps_gives_each_row_its_tokens_in_order():
    # [rows, steps] (runner.py's multi-step decode): every row samples one token a step.
    sampled = torch.tensor([[5, 6, 7], [8, 9, 10]])
    result = AsyncOutput(["a", "b"], sampled, np.array([True, True])).get_output()
    assert result.sampled_token_ids == [[5, 6, 7], [8, 9, 10]]


def test_logprobs_and_prompt_logprobs_ride_on_the_output():
    from mrv2.sampler import LogprobsTensors

    sample = LogprobsTensors(torch.tensor([[5, 5], [7, 1]]), torch.tensor([[-0.5, -0.5],
                                                                          [-2.0, -0.25]]),
                             torch.tensor([1, 4]))
    prompt = LogprobsTensors(torch.tensor([[3, 9], [4, 4]]), torch.tensor([[-1.0, -0.5],
                                                                          [-0.1, -0.1]]),
                             torch.tensor([2, 1]))
    out = AsyncOutput(["a", "b"], torch.tensor([5, 7]), np.array([True, False]),
                      logprobs=sample, num_logprobs=np.array([1, 0]),
                      prompt_logprobs={"b": (6, prompt)}).get_output()
    assert out.logprobs[0][0].token_ids == [5, 5] and out.logprobs[1] is None  # b mid-prefill
    chunk = out.prompt_logprobs["b"]
    assert (chunk.start, chunk.token_ids, chunk.ranks) == (6, [[3, 9], [4, 4]], [2, 1])
    assert chunk.logprobs == [[-1.0, -0.5], [pytest.approx(-0.1)] * 2]
    plain = AsyncOutput(["a"], torch.tensor([5]), np.array([True])).get_output()
    assert plain.logprobs is None and plain.prompt_logprobs is None


def test_nan_rows_name_their_requests():
    """Rows whose logits held a NaN are reported by request id, counted; a row
    still in its prefill (it sampled nothing) is not."""
    out = AsyncOutput(["a", "b", "c"], torch.tensor([5, 7, 9]), np.array([True, True, False]),
                      nan_rows=torch.tensor([False, True, True])).get_output()
    assert out.nan_req_ids == ["b"]
    assert out.sampled_token_ids == [[5], [7], []]
    clean = AsyncOutput(["a"], torch.tensor([5]), np.array([True])).get_output()
    assert clean.nan_req_ids == []


def test_empty_batch():
    out = AsyncOutput([], torch.zeros(0, dtype=torch.int64), np.zeros(0, dtype=bool))
    assert out.get_output().sampled_token_ids == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copy_on_side_stream_survives_reuse_of_the_device_tensor():
    stream = torch.cuda.Stream()
    sampled = torch.arange(1000, device="cuda")
    out = AsyncOutput([str(i) for i in range(1000)], sampled, np.ones(1000, dtype=bool), stream)
    del sampled  # the output keeps the device tensor alive until the copy is done
    torch.cuda.empty_cache()
    garbage = torch.full((1000,), -1, device="cuda")
    assert [t for [t] in out.get_output().sampled_token_ids] == list(range(1000))
    assert int(garbage[0]) == -1


def test_verify_rows_tokens_and_logprobs_per_request():
    """Speculative decoding's output: a request's first num_sampled tokens of its row, and a
    logprobs row per token, request after request."""
    sampled = torch.tensor([[4, 5, 6], [7, 0, 0], [9, 9, 9]])
    rows = LogprobsTensors(torch.tensor([[4, 1], [5, 1], [6, 2], [7, 3]]),
                           torch.full((4, 2), -0.5), torch.tensor([1, 1, 2, 1]))
    out = AsyncOutput(["a", "b", "c"], sampled, np.array([True, True, False]),
                      logprobs=rows, num_logprobs=np.array([1, 0, -1]),
                      num_sampled=np.array([3, 1, 0]),
                      drafts=(np.array([2, 0, 0]), np.array([8, 3]),
                              np.array([0, 4, 0]))).get_output()
    assert out.sampled_token_ids == [[4, 5, 6], [7], []]
    assert out.draft_token_ids == [[8, 3], [], []]
    assert out.draft_pauses.tolist() == [0, 4, 0]
    assert [[lp.token_ids for lp in group] for group in out.logprobs[:2]] == [
        [[4, 1], [5, 1], [6, 2]], [[7]]]
    assert out.logprobs[2] is None
