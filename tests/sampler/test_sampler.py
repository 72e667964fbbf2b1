"""Sampler: greedy semantics, seeded batch invariance, and chi-square goodness of fit of the
filtered distributions against an independent float64 reference. Every call goes through the
per-slot states, as the runner makes it (harness in conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import mrv2.sampler.sampler_torch as sampler_module
from mrv2.sampling_params import SamplingParams
from sampler_harness import make_batch

N_DRAWS = 20_000


def sample(logits: Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=0,
           positions=0, *, triton: bool = False) -> Tensor:
    """Per-row parameters (a scalar applies to every row). Rows whose parameters are all
    scalars share one slot (idx_mapping all zeros); otherwise each row is its own request."""
    b = logits.shape[0]
    columns = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seeds)
    per_row = {k: (v.tolist() if isinstance(v, Tensor) else v) for k, v in columns.items()}
    if all(not isinstance(v, list) for v in per_row.values()):
        params = [SamplingParams(**per_row)]
        idx = [0] * b
    else:
        rows = [{k: (v[i] if isinstance(v, list) else v) for k, v in per_row.items()}
                for i in range(b)]
        params = [SamplingParams(**r) for r in rows]
        idx = list(range(b))
    batch = make_batch(params, logits.shape[1], idx=idx, positions=positions)
    return batch.sample(logits, triton=triton).sampled


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    expected = logits.float().argmax(-1)
    assert torch.equal(sample(logits, temperature=0.0), expected)
    # The mixed path (greedy rows next to random ones, every filter stage on) keeps greedy rows
    # exact and ignores their filter parameters.
    temps = [0.0, 0.8] * 16
    got = sample(logits, temperature=temps, top_k=[0, 5] * 16, top_p=[0.5, 0.9] * 16,
                 min_p=[0.3, 0.1] * 16, seeds=7, positions=torch.arange(32))
    assert torch.equal(got[0::2], expected[0::2])
    assert got.dtype == torch.int64
    assert torch.equal(logits, before)  # the caller's logits are never modified


def test_greedy_ties_pick_lowest_index() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert sample(logits, temperature=0.0).tolist() == [1, 0]
    assert sample(logits, temperature=[0.0, 0.0], top_k=[3, 0]).tolist() == [1, 0]


def test_degenerate_filters_are_greedy() -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(-1)
    positions = torch.arange(64)
    assert torch.equal(sample(logits, temperature=1.3, top_k=1, positions=positions), expected)
    assert torch.equal(sample(logits, top_p=1e-6, positions=positions), expected)
    assert torch.equal(sample(logits, min_p=1.0, positions=positions), expected)


# --------------------------------------------------------------------------- seeding


def test_seeded_row_is_batch_invariant() -> None:
    g = torch.Generator().manual_seed(2)
    b, v = 16, 1000
    logits = torch.randn(b, v, generator=g) * 2
    # Every combination of on/off stages, greedy rows included, so "off" values inside an
    # enabled stage are exercised too.
    temp = torch.tensor([0.7, 1.0, 0.0, 1.5] * 4)
    top_k = torch.tensor([0, 50, 5, -1, 20, 0, 0, 1000, 3, 0, 7, 0, 0, 40, 2, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5] * 2 + [0.95, 1.0, 0.3, 1.0] * 2)
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.05, 0.0, 0.2, 0.0, 0.0] * 2)
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=g)
    positions = torch.randint(0, 4096, (b,), generator=g)

    alone = torch.cat([
        sample(logits[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], min_p[i:i + 1],
               seeds[i:i + 1], positions[i:i + 1])
        for i in range(b)
    ])
    together = sample(logits, temp, top_k, top_p, min_p, seeds, positions)
    assert torch.equal(together, alone)
    for trial in range(4):
        perm = torch.randperm(b, generator=g)
        got = sample(logits[perm], temp[perm], top_k[perm], top_p[perm], min_p[perm],
                     seeds[perm], positions[perm])
        assert torch.equal(got, alone[perm]), f"permutation {trial}"


def test_row_tiling_does_not_change_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 1000, generator=g)
    params = dict(temperature=torch.rand(37, generator=g) * (torch.arange(37) % 3 > 0),
                  top_k=torch.randint(-1, 60, (37,), generator=g), top_p=0.9, min_p=0.02,
                  seeds=torch.arange(37) * 31, positions=torch.arange(37) + 5)
    whole = sample(logits, **params)  # one tile: 37 * 1000 elements < TILE_ELEMS
    monkeypatch.setattr(sampler_module, "TILE_ELEMS", 4000)  # 4 rows per tile, ragged last
    assert torch.equal(sample(logits, **params), whole)


def test_other_seeds_and_positions_differ() -> None:
    logits = torch.zeros(64, 1000)  # uniform: 64 draws almost surely hit many distinct tokens
    by_seed = sample(logits, seeds=torch.arange(64), positions=3)
    by_position = sample(logits, seeds=11, positions=torch.arange(64))
    assert by_seed.unique().numel() >= 55
    assert by_position.unique().numel() >= 55
    assert not torch.equal(by_seed, by_position)
    # Same (seed, position) twice: same token.
    assert torch.equal(by_seed, sample(logits, seeds=torch.arange(64), positions=3))


# --------------------------------------------------------------------------- distribution

LOGITS = [2.0, 1.6, 1.1, 0.9, 0.45, 0.3, -0.1, -0.5, -0.9, -1.4, -2.0, -3.1]


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float,
                    min_p: float) -> list[float]:
    """The exact filtered softmax in float64, written independently of the sampler. It asserts
    that no cut-off sits within 1e-3 of a boundary, so float32 rounding cannot flip a token."""
    x = [v / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = set(range(len(x)))
    if min_p > 0:
        for i in range(len(x)):
            ratio = math.exp(x[i] - x[order[0]])
            assert abs(ratio - min_p) > 1e-3
            if ratio < min_p:
                keep.discard(i)
    if top_k > 0:
        keep &= set(order[:top_k])
    if top_p < 1:
        z = sum(math.exp(x[i]) for i in keep)
        cum, kept = 0.0, set()
        for i in (i for i in order if i in keep):
            kept.add(i)
            cum += math.exp(x[i]) / z
            assert abs(cum - top_p) > 1e-3
            if cum >= top_p:
                break
        keep = kept
    z = sum(math.exp(x[i]) for i in keep)
    return [math.exp(x[i]) / z if i in keep else 0.0 for i in range(len(x))]


def chi_square_pvalue(counts: Tensor, probs: list[float]) -> float:
    """Pearson chi-square over tokens with p > 0.001 (the rest lumped into one bin if it is big
    enough); survival function via the regularised upper incomplete gamma (no scipy here)."""
    n = int(counts.sum())
    p = torch.tensor(probs, dtype=torch.float64)
    big = p > 1e-3
    observed, expected = counts[big].double(), p[big] * n
    rest_expected = float(p[~big].sum()) * n
    if rest_expected >= 5:
        observed = torch.cat([observed, counts[~big].sum().double().view(1)])
        expected = torch.cat([expected, torch.tensor([rest_expected], dtype=torch.float64)])
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


CASES = {
    "temperature": dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    "hot": dict(temperature=1.8, top_k=0, top_p=1.0, min_p=0.0),
    "top_k": dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0),
    "top_p": dict(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0),
    "min_p": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.12),
    # top_p sees the renormalised survivors: over all 12 tokens it would keep 4, not 3.
    "top_k_bound_combo": dict(temperature=0.8, top_k=6, top_p=0.78, min_p=0.05),
    "min_p_bound_combo": dict(temperature=0.8, top_k=8, top_p=0.76, min_p=0.05),
}


@pytest.mark.parametrize("vary", ["position", "seed"])
@pytest.mark.parametrize("case", list(CASES))
def test_distribution_matches_filtered_softmax(case: str, vary: str) -> None:
    params = CASES[case]
    probs = reference_probs(LOGITS, **params)
    logits = torch.tensor(LOGITS).expand(N_DRAWS, -1)
    draws = torch.arange(N_DRAWS)
    if vary == "position":
        tokens = sample(logits, **params, seeds=1234, positions=draws)
    else:
        tokens = sample(logits, **params, seeds=draws * 7919 - 10**6, positions=99)
    counts = torch.bincount(tokens, minlength=len(LOGITS))
    dropped = torch.tensor([p == 0.0 for p in probs])
    assert int(counts[dropped].sum()) == 0, "sampled a filtered-out token"
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_chi_square_has_power() -> None:
    """The same statistic rejects a slightly wrong temperature, so passing above means something."""
    logits = torch.tensor(LOGITS).expand(N_DRAWS, -1)
    tokens = sample(logits, temperature=0.9, seeds=1234, positions=torch.arange(N_DRAWS))
    counts = torch.bincount(tokens, minlength=len(LOGITS))
    assert chi_square_pvalue(counts, reference_probs(LOGITS, 1.0, 0, 1.0, 0.0)) < 1e-6


def test_partial_sort_equals_full_sort() -> None:
    """With max_top_k the filters sort only the top values; the kept set is bit-for-bit the
    full sort's, so a row gives the same token whether its batch allowed the partial sort or
    not (a top-p-only row forces the full sort)."""
    from mrv2.sampler.filters import apply_top_k_top_p_

    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 5000, generator=g) * 2
    top_k = torch.randint(1, 200, (64,), generator=g)
    top_p = torch.rand(64, generator=g) * 0.9 + 0.05
    for p in (None, top_p):
        full = apply_top_k_top_p_(x.clone(), top_k, p)
        partial = apply_top_k_top_p_(x.clone(), top_k, p, max_top_k=int(top_k.max()))
        assert torch.equal(full, partial)
    # Through the sampler: the same seeded rows, next to a top-p-only row or not.
    params = dict(temperature=0.9, top_k=top_k[:8], top_p=top_p[:8], seeds=torch.arange(8),
                  positions=torch.arange(8))
    alone = sample(x[:8], **params)
    extra = dict(temperature=0.9, top_k=torch.cat([top_k[:8], torch.tensor([0])]),
                 top_p=torch.cat([top_p[:8], torch.tensor([0.5])]), seeds=torch.arange(9),
                 positions=torch.arange(9))
    with_top_p_only_row = sample(torch.cat([x[:8], x[8:9]]), **extra)
    assert torch.equal(with_top_p_only_row[:8], alone)


@pytest.mark.parametrize("tile_elems", [1 << 20, 3000])
def test_seeded_request_with_every_feature_is_batch_invariant(
        tile_elems: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each seeded request alone, in a batch of 16 others, and at other batch positions and
    slots: the same token and the same logprobs. Stages run on row subsets of each tile, so a
    row is processed through other index paths alone than in a batch; the results must not
    care."""
    monkeypatch.setattr(sampler_module, "TILE_ELEMS", tile_elems)
    vocab = 600
    g = torch.Generator().manual_seed(21)
    features = [
        dict(), dict(top_k=20), dict(top_p=0.8), dict(min_p=0.05), dict(temperature=0.0),
        dict(presence_penalty=1.0, frequency_penalty=0.5), dict(repetition_penalty=1.5),
        dict(logit_bias={5: 3.0, 17: -2.0}), dict(allowed_token_ids=list(range(0, vocab, 4))),
        dict(min_tokens=5, stop_token_ids=[1, 2]), dict(logprobs=4),
        dict(temperature=0.0, repetition_penalty=1.2, logprobs=2),
        dict(top_k=50, top_p=0.9, presence_penalty=0.5, logprobs=1),
        dict(temperature=1.7, min_p=0.1, logit_bias={9: 1.0}), dict(top_k=3),
        dict(allowed_token_ids=[3, 4, 5], logprobs=0), dict(frequency_penalty=-1.0, top_p=0.5),
    ]
    params = [SamplingParams(**{"temperature": 0.9, "seed": 77 * i, **f})
              for i, f in enumerate(features)]
    n = len(params)
    prompts = [torch.randint(0, vocab, (3 + i,), generator=g).tolist() for i in range(n)]
    outputs = [torch.randint(0, vocab, (i % 4,), generator=g).tolist() for i in range(n)]
    logits = torch.randn(n, vocab, generator=g) * 2

    def run(order: list[int], slots: list[int]):
        batch = make_batch([params[i] for i in order], vocab,
                           prompts=[prompts[i] for i in order],
                           outputs=[outputs[i] for i in order], slots=slots,
                           num_slots=max(slots) + 1, eos_token_id=2)
        out = batch.sample(logits[order])
        lp = out.logprobs
        return {i: (out.sampled[r].item(),
                    None if lp is None or params[i].logprobs is None
                    else lp.logprobs[r, :params[i].logprobs + 1].tolist())
                for r, i in enumerate(order)}

    alone = {}
    for i in range(n):
        alone.update(run([i], [0]))
    assert run(list(range(n)), list(range(n))) == alone
    for trial in range(2):
        order = torch.randperm(n, generator=g).tolist()
        slots = torch.randperm(40, generator=g)[:n].tolist()
        assert run(order, slots) == alone, f"permutation {trial}"
