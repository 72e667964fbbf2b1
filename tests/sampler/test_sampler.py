"""Sampler: greedy semantics, seeded batch invariance, and chi-square goodness of fit of the
filtered distributions against an independent float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import mrv2.sampler.sampler as sampler_module
from mrv2.sampler import Sampler

SAMPLER = Sampler()
N_DRAWS = 20_000


def sample(logits: Tensor, temperature: float | list[float] = 1.0, top_k: int | list[int] = 0,
           top_p: float | list[float] = 1.0, min_p: float | list[float] = 0.0,
           seeds: Tensor | int = 0, positions: Tensor | int = 0) -> Tensor:
    """Broadcast scalar params to the batch and derive the host flags the runner would."""
    b = logits.shape[0]

    def col(v: object, dtype: torch.dtype) -> Tensor:
        t = v if isinstance(v, Tensor) else torch.tensor(v, dtype=dtype)
        return t.to(dtype).expand(b).contiguous() if t.dim() == 0 else t.to(dtype)

    temp, k = col(temperature, torch.float32), col(top_k, torch.int32)
    p, m = col(top_p, torch.float32), col(min_p, torch.float32)
    return SAMPLER(
        logits, temp, k, p, m, col(seeds, torch.int64), col(positions, torch.int64),
        any_top_k=bool((k > 0).any()), any_top_p=bool((p < 1).any()),
        any_min_p=bool((m > 0).any()), all_greedy=bool((temp == 0).all()),
        all_random=bool((temp > 0).all()),
    )


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
