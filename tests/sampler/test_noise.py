"""The counter-based hash behind the Gumbel noise: bit-exact against a pure-Python uint64
reference (so int64 wrapping and the emulated logical shifts are right), and the uniform it
produces is strictly inside (0, 1)."""

from __future__ import annotations

import torch

from mrv2.sampler.noise import (
    GAMMA,
    MIX1,
    MIX2,
    UNIFORM_BITS,
    bits_to_uniform,
    gumbel_noise,
    mix64,
    random_bits,
)

U64 = (1 << 64) - 1


def ref_mix64(z: int) -> int:
    z &= U64
    z = ((z ^ (z >> 30)) * MIX1) & U64
    z = ((z ^ (z >> 27)) * MIX2) & U64
    return z ^ (z >> 31)


def ref_bits(seed: int, position: int, token: int) -> int:
    key = ref_mix64(ref_mix64(seed + GAMMA) ^ (position & U64))
    return ref_mix64(key + (token + 1) * GAMMA) >> (64 - UNIFORM_BITS)


def as_i64(z: int) -> int:
    return z - (1 << 64) if z >= 1 << 63 else z


# Negative and extreme values exercise the sign bit, where int64 ">>" differs from uint64's.
EDGE = [0, 1, -1, 2, 42, 2**31, 2**32 + 7, 2**62, 2**63 - 1, -(2**63), -123456789, 987654321987]


def test_mix64_matches_uint64_reference() -> None:
    z = torch.tensor(EDGE, dtype=torch.int64)
    got = mix64(z).tolist()
    assert got == [as_i64(ref_mix64(v)) for v in EDGE]
    assert z.tolist() == EDGE  # input untouched


def test_random_bits_match_reference() -> None:
    seeds = torch.tensor(EDGE, dtype=torch.int64)
    positions = torch.tensor(list(reversed(EDGE)), dtype=torch.int64)
    vocab = 37
    got = random_bits(seeds, positions, vocab)
    assert got.shape == (len(EDGE), vocab) and got.dtype == torch.int64
    for r, (s, p) in enumerate(zip(EDGE, reversed(EDGE))):
        assert got[r].tolist() == [ref_bits(s, p, t) for t in range(vocab)]


def test_uniform_never_zero_or_one() -> None:
    extremes = torch.tensor([0, 1, (1 << UNIFORM_BITS) - 2, (1 << UNIFORM_BITS) - 1])
    u = bits_to_uniform(extremes)
    assert u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert u[0].item() == 2.0 ** -(UNIFORM_BITS + 1)
    assert u[-1].item() == 1.0 - 2.0 ** -(UNIFORM_BITS + 1)
    g = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(g).all())


def test_gumbel_noise_is_finite_and_gumbel_distributed() -> None:
    n = 4096
    g = gumbel_noise(torch.arange(n), torch.zeros(n, dtype=torch.int64), 64)
    assert g.shape == (n, 64) and g.dtype == torch.float32
    assert bool(torch.isfinite(g).all())
    # Standard Gumbel: mean = Euler-Mascheroni ~0.5772, variance = pi^2 / 6 ~1.6449.
    assert abs(g.mean().item() - 0.5772) < 0.01
    assert abs(g.var().item() - 1.6449) < 0.03


def test_noise_depends_only_on_seed_position_token() -> None:
    seeds = torch.tensor([5, 9, 5, 5])
    positions = torch.tensor([3, 3, 3, 4])
    g = gumbel_noise(seeds, positions, 100)
    assert torch.equal(g[0], g[2])  # same (seed, position): identical row
    assert not torch.equal(g[0], g[1])  # other seed
    assert not torch.equal(g[0], g[3])  # other position
    # A longer vocabulary extends the row without changing its prefix.
    assert torch.equal(gumbel_noise(seeds, positions, 300)[:, :100], g)
