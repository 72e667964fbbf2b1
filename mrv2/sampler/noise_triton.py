"""Triton kernel: temperature + Gumbel-max sampling with the keyed noise of noise.py.

One program per (batch row, vocab block) writes its block's maximum of
``x / temperature + gumbel(seed, position, token)`` (greedy rows, temperature 0: of ``x``)
and the lowest token index reaching it; a torch argmax over the blocks (first maximum wins)
finishes. Ties therefore go to the lowest token index, as ``torch.argmax`` on the torch path.

Exactness against the torch path (noise.py, sampler.py):

- the 64-bit hash and the 23 random bits are bit-for-bit equal (uint64 arithmetic here, the
  int64 emulation there);
- ``u = (bits + 0.5) * 2**-23`` is exact in both;
- ``-log(-log(u))`` agrees within float tolerance, not bit for bit: numpy's (interpreter) and
  the GPU's ``log`` differ from torch's by about an ulp;
- the temperature division is ``div_rn`` (IEEE, as torch), so ``x / t`` is exact-equal.

So the sampled token equals the torch path's unless two candidates are within ~1e-6 of each
other after the noise, which the tests' continuous random logits never produce.
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from mrv2.sampler.noise import UNIFORM_BITS
from mrv2.platform import triton_kernel

# Globals a kernel reads must be constexpr.
_UNIFORM_SCALE = tl.constexpr(2.0 ** -UNIFORM_BITS)
_SHIFT = tl.constexpr(64 - UNIFORM_BITS)


def _gumbel_argmax_kernel(x_ptr, x_stride, idx_mapping_ptr, temperature_ptr, seed_ptr, pos_ptr,
                          block_max_ptr, block_idx_ptr, num_blocks, vocab_size,
                          APPLY_TEMPERATURE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    temperature = tl.load(temperature_ptr + slot)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=float("-inf"))
    if temperature != 0.0:
        if APPLY_TEMPERATURE:
            x = tl.math.div_rn(x, temperature)
        # row_key = mix64(mix64(seed + GAMMA) ^ position), the splitmix64 finaliser inlined
        # (kernels call no helper functions; see mrv2/platform.py).
        z = tl.load(seed_ptr + slot).to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        z = z ^ tl.load(pos_ptr + row).to(tl.uint64, bitcast=True)
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        key = z ^ (z >> 31)
        # bits = mix64(key + (token + 1) * GAMMA) >> 41; the final xorshift of mix64 only
        # touches bits 0..32, so it is skipped (as in noise.py).
        h = key + (offs + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB
        bits = (h >> _SHIFT).to(tl.int32)
        u = (bits.to(tl.float32) + 0.5) * _UNIFORM_SCALE
        x = x + -tl.log(-tl.log(u))
    x = tl.where(mask, x, float("-inf"))
    best = tl.reduce(x, 0, tl.standard._elementwise_max)
    best_idx = tl.reduce(tl.where(x == best, offs, vocab_size), 0,
                         tl.standard._elementwise_min)
    tl.store(block_max_ptr + row * num_blocks + block, best)
    tl.store(block_idx_ptr + row * num_blocks + block, best_idx)


def gumbel_block_argmax(x: Tensor, idx_mapping: Tensor, temperature: Tensor, seed: Tensor,
                        positions: Tensor, *, apply_temperature: bool,
                        block: int = 4096) -> tuple[Tensor, Tensor]:
    """Per (row, vocab block): the maximum of the noisy logits and the lowest token index
    reaching it; ``[B, num_blocks]`` float32 and int32."""
    num_rows, vocab_size = x.shape
    assert x.stride(1) == 1, "logits rows must be contiguous"
    num_blocks = (vocab_size + block - 1) // block
    block_max = torch.empty(num_rows, num_blocks, dtype=torch.float32, device=x.device)
    block_idx = torch.empty(num_rows, num_blocks, dtype=torch.int32, device=x.device)
    if num_rows:
        triton_kernel(_gumbel_argmax_kernel)[(num_rows, num_blocks)](
            x, x.stride(0), idx_mapping, temperature, seed, positions, block_max, block_idx,
            num_blocks, vocab_size, APPLY_TEMPERATURE=apply_temperature, BLOCK=block)
    return block_max, block_idx


def gumbel_sample(x: Tensor, idx_mapping: Tensor, temperature: Tensor, seed: Tensor,
                  positions: Tensor, *, apply_temperature: bool, block: int = 4096) -> Tensor:
    """Sample one token per row of float32 ``x`` [B, V]; ``temperature`` and ``seed`` are the
    per-slot tables (read through ``idx_mapping``). With ``apply_temperature=False`` the caller
    has already divided ``x`` by the temperature. ``x`` is not modified. Returns [B] int64."""
    block_max, block_idx = gumbel_block_argmax(x, idx_mapping, temperature, seed, positions,
                                               apply_temperature=apply_temperature, block=block)
    best_block = block_max.argmax(dim=1, keepdim=True)  # first maximum: the lowest block
    return block_idx.gather(1, best_block).squeeze(1).long()
