"""The sampler on 256 decoding requests over a 32,000 and a 151,936-token vocabulary.

Cases per vocabulary (one group each):

- ``greedy``: every request greedy, no processing (the argmax fast path);
- ``all_features``: every request random with temperature, top-k, top-p, min-p, all three
  penalties, a 16-entry logit bias, min_tokens, 1,024 allowed_token_ids and 5 logprobs;
- ``mixed``: a quarter greedy, a quarter plain temperature, a quarter top-k + top-p, a
  quarter penalties + logprobs;
- ``top_p`` / ``top_k_top_p_unbounded``: every request random with top-p 0.9 (and, in the
  second, top-k 5,000, which the host bound does not cover): the threshold search, parametrised
  ``filters=search`` against ``filters=sort`` (the former full sort, tests/sampler/
  filters_helpers.py) in the same run;
- ``reference_multinomial``: the baseline in the same run, ``softmax(logits / T)`` then
  ``torch.multinomial`` (no filters, not batch-invariant): compare the cases to it as ratios.

A round is what the runner does per step: ``Sampler(...)`` then ``SamplingStates.post_update``
(the penalty counts). On CPU the torch path runs; on CUDA the Triton one. Rounds are few: a
151,936-token all-features round takes about a second on a 2-core machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mrv2.platform import default_device
from mrv2.sampler import Sampler, SamplingStates
from mrv2.sampling_params import SamplingParams
from mrv2.state.requests import RequestState

NUM_REQS = 256
VOCABS = [32_000, 151_936]
ROUNDS = 3


def _params(case: str, i: int, vocab: int) -> SamplingParams:
    seed = 1000 + i
    if case == "greedy":
        return SamplingParams(temperature=0.0)
    if case == "all_features":
        return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=seed,
                              repetition_penalty=1.1, presence_penalty=0.3,
                              frequency_penalty=0.2,
                              logit_bias={(37 * j + i) % vocab: 0.5 for j in range(16)},
                              min_tokens=4, stop_token_ids=[3],
                              allowed_token_ids=list(range(i % 7, vocab, vocab // 1024))[:1024],
                              logprobs=5)
    if case == "top_p":
        return SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
    if case == "top_k_top_p_unbounded":
        return SamplingParams(temperature=0.8, top_k=5000, top_p=0.9, seed=seed)
    # mixed
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0.0)
    if kind == 1:
        return SamplingParams(temperature=0.7, seed=seed)
    if kind == 2:
        return SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=seed)
    return SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.5,
                          logprobs=3, seed=seed)


class Workload:
    def __init__(self, case: str, vocab: int, num_reqs: int = NUM_REQS) -> None:
        device = default_device()
        g = torch.Generator().manual_seed(vocab)
        self.logits = (torch.randn(num_reqs, vocab, generator=g) * 3).to(device)
        prompt = torch.randint(0, vocab, (256,), generator=g).tolist()
        requests = RequestState(num_reqs, len(prompt) + 1, device)
        self.states = SamplingStates(requests, vocab, engine_seed=0, eos_token_ids=(2,))
        for i in range(num_reqs):
            slot = requests.add(f"req-{i}", len(prompt), prompt, num_computed_tokens=len(prompt))
            self.states.add(slot, f"req-{i}", _params(case, i, vocab), prompt)
        requests.apply_staged_writes()
        self.states.apply_staged_writes()
        self.sampler = Sampler(self.states)
        # Slots in a shuffled batch order, as a runner's batch is.
        self.idx_np = torch.randperm(num_reqs, generator=g).numpy()
        self.idx = torch.from_numpy(self.idx_np).to(device)
        self.positions = torch.full((num_reqs,), len(prompt), dtype=torch.int64, device=device)

    def step(self) -> torch.Tensor:
        out = self.sampler(self.logits, self.idx, self.idx_np, self.positions)
        self.states.post_update(self.idx, self.idx_np, self.positions, out.sampled)
        self.positions += 1
        return out.sampled


def _num_reqs(benchmark) -> int:
    """The suite's untimed pass only checks that each case runs: 8 requests do."""
    return 8 if benchmark.disabled else NUM_REQS


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("case", ["greedy", "all_features", "mixed"])
def test_sampler(benchmark, case: str, vocab: int) -> None:
    benchmark.group = f"sampler-{vocab}"
    workload = Workload(case, vocab, _num_reqs(benchmark))
    benchmark.extra_info.update(num_reqs=workload.logits.shape[0], vocab=vocab)

    def step() -> None:
        workload.step()
        _sync()

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("filters", ["search", "sort"])
@pytest.mark.parametrize("case", ["top_p", "top_k_top_p_unbounded"])
def test_sampler_filters(benchmark, monkeypatch, case: str, filters: str, vocab: int) -> None:
    benchmark.group = f"sampler-filters-{vocab}"
    benchmark.extra_info.update(num_reqs=_num_reqs(benchmark), vocab=vocab, filters=filters)
    if filters == "sort":
        sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "sampler"))
        from filters_helpers import reference_top_k_top_p_

        from mrv2.sampler import sampler_torch, sampler_triton

        monkeypatch.setattr(sampler_torch, "apply_top_k_top_p_", reference_top_k_top_p_)
        monkeypatch.setattr(sampler_triton, "apply_top_k_top_p_", reference_top_k_top_p_)
    workload = Workload(case, vocab, _num_reqs(benchmark))

    def step() -> None:
        workload.step()
        _sync()

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1)


@pytest.mark.parametrize("vocab", VOCABS)
def test_reference_multinomial(benchmark, vocab: int) -> None:
    benchmark.group = f"sampler-{vocab}"
    device = default_device()
    logits = (torch.randn(NUM_REQS, vocab, generator=torch.Generator().manual_seed(vocab))
              * 3).to(device)
    temperature = torch.full((NUM_REQS, 1), 0.8, device=device)

    def step() -> None:
        torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1)
        _sync()

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1)


@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.parametrize("impl", ["numba", "torch_max"])
def test_greedy_argmax(benchmark, impl: str, rows: int) -> None:
    """The greedy fast path's argmax alone on float32 CPU logits, SmolLM2's vocabulary
    (49,152): greedy_numba's kernel against torch's max(dim) (the fallback) in the same run."""
    from mrv2.sampler import greedy_numba
    from mrv2.sampler.sampler_torch import greedy_argmax_torch

    benchmark.group = f"greedy-argmax-{rows}"
    logits = torch.randn(rows, 49_152, generator=torch.Generator().manual_seed(rows))
    fn = greedy_numba.greedy_argmax_float32 if impl == "numba" else greedy_argmax_torch
    assert torch.equal(fn(logits)[0], logits.argmax(dim=-1))
    benchmark.pedantic(fn, args=(logits,), rounds=1 if benchmark.disabled else 200,
                       warmup_rounds=0 if benchmark.disabled else 5)
