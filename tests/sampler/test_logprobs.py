"""Logprobs: the sampled token's logprob and rank and the top-k, against torch.log_softmax,
in every logprobs_mode; chunked prompt logprobs; trimming per request."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.sampler import Sampler
from mrv2.sampler.filters import apply_top_k_top_p_
from mrv2.sampler.logprobs import LogprobsTensors, compute_logprobs, prompt_logprobs
from mrv2.sampling_params import SamplingParams
from sampler_harness import make_batch, random_logits

V = 1000
NUM_LOGPROBS = [5, None, 0, 20, 3, 1, None, 20]
PARAMS = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.2, top_k=30),
    SamplingParams(temperature=0.0, presence_penalty=1.0, logit_bias={3: 2.0}),
    SamplingParams(temperature=0.7, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, allowed_token_ids=list(range(0, V, 3))),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
]


def check_against_log_softmax(out: LogprobsTensors, reference_logits: torch.Tensor,
                              sampled: torch.Tensor, k: int, atol: float = 1e-5) -> None:
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    chosen = ref.gather(1, sampled.unsqueeze(1))
    torch.testing.assert_close(out.logprobs[:, :1].double(), chosen, rtol=0, atol=atol)
    assert torch.equal(out.token_ids[:, 0], sampled)
    assert torch.equal(out.ranks, (reference_logits >= reference_logits.gather(
        1, sampled.unsqueeze(1))).sum(-1))
    if k:
        top = ref.topk(k, dim=-1)
        torch.testing.assert_close(out.logprobs[:, 1:].double(), top.values, rtol=0, atol=atol)
        assert torch.equal(out.token_ids[:, 1:], top.indices)


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_raw_logprobs_match_log_softmax(triton: bool) -> None:
    params = [p.clone(logprobs=n) for p, n in zip(PARAMS, NUM_LOGPROBS)]
    batch = make_batch(params, V, outputs=[[4, 4, 9]] * len(params))
    logits = random_logits(len(params), V, seed=0)
    out = batch.sample(logits, triton=triton)
    assert out.logprobs is not None
    assert out.logprobs.token_ids.shape == (len(params), 21)
    asked = torch.tensor([n is not None for n in NUM_LOGPROBS])
    lp = out.logprobs
    check_against_log_softmax(LogprobsTensors(lp.token_ids[asked], lp.logprobs[asked],
                                              lp.ranks[asked]),
                              logits[asked], out.sampled[asked], 20)
    # Trimmed per request: 1 + its own k entries, None where it asked for none.
    lists = out.logprobs.to_lists(batch.states.num_logprobs(batch.idx.numpy()))
    for row, n in enumerate(NUM_LOGPROBS):
        if n is None:
            assert lists[row] is None
        else:
            ids, lps, rank = lists[row]
            assert len(ids) == len(lps) == n + 1 and ids[0] == out.sampled[row].item()
            assert rank == out.logprobs.ranks[row].item() and rank >= 1


def test_no_logprobs_requested() -> None:
    batch = make_batch(PARAMS, V)
    assert batch.sample(random_logits(len(PARAMS), V, seed=1)).logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rank_is_one_and_raw_ignores_processing(dtype: torch.dtype) -> None:
    logits = random_logits(4, V, seed=2).to(dtype)
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 2 + [
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={7: 50.0})] * 2
    batch = make_batch(params, V)
    out = batch.sample(logits)
    assert out.logprobs.ranks[:2].tolist() == [1, 1]
    assert out.sampled[2:].tolist() == [7, 7]
    # Raw: the biased token's logprob is the one under the model's logits.
    check_against_log_softmax(out.logprobs, logits.float(), out.sampled, 2)


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_processed_logprobs_are_the_sampling_distribution(triton: bool) -> None:
    """processed_logprobs = log_softmax of (logits / T, top-k filtered): filtered tokens are
    -inf and the kept ones renormalised."""
    params = [SamplingParams(temperature=0.6, top_k=7, seed=s, logprobs=10) for s in range(4)]
    batch = make_batch(params, V)
    logits = random_logits(4, V, seed=3)
    out = batch.sample(logits, mode="processed_logprobs", triton=triton)
    reference = logits / 0.6
    apply_top_k_top_p_(reference, torch.full((4,), 7), None)
    lp = out.logprobs.logprobs
    check_against_log_softmax(
        LogprobsTensors(out.logprobs.token_ids[:, :8], lp[:, :8], out.logprobs.ranks),
        reference, out.sampled, 7)
    assert bool(torch.isinf(lp[:, 8:]).all())  # only 7 tokens survive top-k
    assert bool((out.logprobs.ranks <= 7).all())


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits"])
@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_logits_modes_return_logit_values(mode: str, triton: bool) -> None:
    params = [SamplingParams(temperature=0.5, logprobs=3, seed=1),
              SamplingParams(temperature=0.0, logprobs=3)]
    batch = make_batch(params, V)
    logits = random_logits(2, V, seed=4)
    out = batch.sample(logits, mode=mode, triton=triton)
    scale = torch.tensor([[0.5], [1.0]]) if mode == "processed_logits" else 1.0
    expected = (logits / scale).gather(1, out.logprobs.token_ids)
    torch.testing.assert_close(out.logprobs.logprobs, expected, rtol=1e-6, atol=1e-6)


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(make_batch([SamplingParams()], 10).states, logprobs_mode="softmax")


def test_compute_logprobs_handles_filtered_rows() -> None:
    x = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    out = compute_logprobs(x, torch.tensor([2]), 3)
    ref = torch.log_softmax(x, -1)
    assert out.token_ids[0, :3].tolist() == [2, 2, 0]
    assert out.token_ids[0, 3].item() in (1, 3)  # a tie between -inf tokens
    torch.testing.assert_close(out.logprobs[0, :3], ref[0, [2, 2, 0]])
    assert out.logprobs[0, 3].item() == float("-inf")
    assert out.ranks.tolist() == [1]


def test_prompt_logprobs_in_chunks() -> None:
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(37, 16, generator=g)
    head = torch.randn(V, 16, generator=g)
    chunks: list[int] = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        chunks.append(h.shape[0])
        return h @ head.T

    next_tokens = torch.randint(0, V, (37,), generator=g)
    out = prompt_logprobs(hidden, compute_logits, next_tokens, 4, chunk_size=10)
    assert chunks == [10, 10, 10, 7]  # never more than chunk_size rows of logits
    check_against_log_softmax(out, hidden @ head.T, next_tokens, 4, atol=1e-4)
    empty = prompt_logprobs(hidden[:0], compute_logits, next_tokens[:0], 4)
    assert empty.token_ids.shape == (0, 5)


def test_to_lists_on_all_rows() -> None:
    t = LogprobsTensors(torch.tensor([[5, 5, 1], [2, 0, 2]]),
                        torch.tensor([[-0.1, -0.1, -2.0], [-3.0, -0.5, -3.0]]),
                        torch.tensor([1, 2]))
    assert t.to_lists(np.array([2, 0])) == [([5, 5, 1], [pytest.approx(-0.1)] * 2 + [-2.0], 1),
                                           ([2], [-3.0], 2)]
