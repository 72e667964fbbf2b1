"""Counter-based Gumbel noise keyed by (seed, position, token index).

DESIGN.md invariant 7: a seeded request must sample the same token whatever else is in the batch
and wherever it sits. A stateful ``torch.Generator`` cannot give that (its stream is consumed in
batch order), so the noise for element ``(row, token)`` is a pure function of
``(seed[row], position[row], token)``: a 64-bit hash of those integers.

The exact recipe, which any other implementation (e.g. the Triton sampler) must reproduce
bit-for-bit on the integer side. All arithmetic is on uint64 modulo 2**64; ``>>>`` is a logical
right shift::

    mix64(z):  z = (z ^ (z >>> 30)) * 0xBF58476D1CE4E5B9
               z = (z ^ (z >>> 27)) * 0x94D049BB133111EB
               return z ^ (z >>> 31)                  # splitmix64's finaliser (a bijection)
    row_key  = mix64(mix64(seed + GAMMA) ^ position)  # GAMMA = 0x9E3779B97F4A7C15
    bits     = mix64(row_key + (token + 1) * GAMMA) >>> 41     # top 23 bits
    u        = (bits + 0.5) * 2**-23                  # float32, exact
    gumbel   = -log(-log(u))

Why 23 bits and not 24: every ``(k + 0.5) * 2**-23`` with ``k < 2**23`` is exactly representable
in float32 and lies in ``[2**-24, 1 - 2**-24]``, so ``u`` is never 0 or 1 and both logs are
finite. A 24-bit midpoint grid would need 25 significant bits and its top point rounds to 1.0.
Gumbel values then lie in [-2.81, 16.64], so a token is unreachable only if its probability is
below ~4e-9 of the top token's (logit gap > 19.4); far below any sampling-test resolution.

torch has no uint64 arithmetic, so the hash runs on int64: ``+``, ``*``, ``^`` and ``&`` give the
same bits as uint64 (two's complement wraps), but ``>>`` is arithmetic on int64, so a logical
shift is emulated as ``(z >> s) & (2**(64 - s) - 1)``. Constants above 2**63 are written as their
signed int64 equivalents.
"""

from __future__ import annotations

import torch
from torch import Tensor

_U64 = (1 << 64) - 1


def _to_i64(value: int) -> int:
    """The int64 whose two's-complement bits equal the uint64 ``value``."""
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 23  # see the module docstring for why not 24

_GAMMA_I64 = _to_i64(GAMMA)
_MIX1_I64 = _to_i64(MIX1)
_MIX2_I64 = _to_i64(MIX2)


def _xor_lshr_(z: Tensor, shift: int, scratch: Tensor) -> None:
    """In place ``z ^= z >>> shift`` on int64 bits; ``scratch`` is a same-shaped int64 buffer."""
    torch.bitwise_right_shift(z, shift, out=scratch)  # arithmetic: copies the sign bit in
    scratch.bitwise_and_((1 << (64 - shift)) - 1)  # clear the copied sign bits -> logical shift
    z.bitwise_xor_(scratch)


def _mix64_(z: Tensor, scratch: Tensor, *, final_xorshift: bool = True) -> Tensor:
    """In-place splitmix64 finaliser on int64 tensors (wrapping multiply = uint64 multiply)."""
    _xor_lshr_(z, 30, scratch)
    z.mul_(_MIX1_I64)
    _xor_lshr_(z, 27, scratch)
    z.mul_(_MIX2_I64)
    if final_xorshift:
        # ``z ^ (z >>> 31)`` only changes bits 0..32; callers that read only the top bits skip it.
        _xor_lshr_(z, 31, scratch)
    return z


def mix64(z: Tensor) -> Tensor:
    """splitmix64 finaliser of an int64 tensor (a new tensor; the input is untouched)."""
    out = z.to(torch.int64, copy=True)
    return _mix64_(out, torch.empty_like(out))


def row_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """Per-row stream key ``mix64(mix64(seed + GAMMA) ^ position)``; [B] int64."""
    key = mix64(seeds.to(torch.int64) + _GAMMA_I64)
    key.bitwise_xor_(positions.to(torch.int64))
    return mix64(key)


def random_bits(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """The top ``UNIFORM_BITS`` hash bits for every (row, token): [B, V] int64 in [0, 2**23)."""
    key = row_keys(seeds, positions)
    # (token + 1) * GAMMA: the splitmix64 stream of ``key``, so tokens are successive outputs.
    steps = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=key.device).mul_(_GAMMA_I64)
    z = key.unsqueeze(1) + steps.unsqueeze(0)
    scratch = torch.empty_like(z)
    # The skipped final xorshift touches only bits 0..32, and we keep bits 41..63.
    _mix64_(z, scratch, final_xorshift=False)
    shift = 64 - UNIFORM_BITS
    torch.bitwise_right_shift(z, shift, out=scratch)
    return scratch.bitwise_and_((1 << UNIFORM_BITS) - 1)


def bits_to_uniform(bits: Tensor) -> Tensor:
    """Map integers in [0, 2**23) to float32 ``(bits + 0.5) * 2**-23``: strictly inside (0, 1)."""
    u = bits.to(torch.float32)  # exact: bits < 2**24
    return u.add_(0.5).mul_(2.0 ** -UNIFORM_BITS)


def gumbel_noise(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise [B, V] float32, a pure function of (seed, position, token index)."""
    g = bits_to_uniform(random_bits(seeds, positions, vocab_size))
    # -log(-log(u)), in place to keep one [B, V] float buffer alive.
    return g.log_().neg_().log_().neg_()
