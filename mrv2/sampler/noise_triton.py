"""Triton kernel: temperature + Gumbel-max sampling with the keyed noise of noise.py.

One program per (batch row, vocab block) writes its block's maximum of
``x / temperature + gumbel(seed, position, token)`` (greedy rows, temperature 0: of ``x``)
and the lowest token index reaching it; a torch argmax over the blocks (first maximum wins)
finishes. Ties therefore go to the lowest token index, as ``torch.argmax`` on the torch path.
NaN logits read as -inf (so the token is always in the vocabulary) and are reported per row.

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
                          block_max_ptr, block_idx_ptr, block_nan_ptr, num_blocks,
                          vocab_size,
                          APPLY_TEMPERATURE: tl.constexpr, ALL_GREEDY: tl.constexpr,
                          BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    temperature = 0.0
    if not ALL_GREEDY:
        temperature = tl.load(temperature_ptr + slot)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    # NaN reads as -inf (never the maximum); the block reports that it saw one.
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    x = tl.where(is_nan, float("-inf"), x)
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
    # Reductions are trees of public builtins (as in attention/split_kv_triton.py): tl.max and
    # tl.min are jitted helpers the interpreter cannot call once triton was imported compiled.
    # Each step pairs neighbours, the lower-index side first, so ties keep the lowest index.
    v = tl.reshape(tl.where(mask, x, float("-inf")), [1, BLOCK])
    i = tl.reshape(offs, [1, BLOCK])
    nan = tl.reshape(is_nan.to(tl.int8), [1, BLOCK])
    for _ in tl.static_range(LOG2_BLOCK):
        v_lo, v_hi = tl.split(tl.reshape(v, [1, v.shape[1] // 2, 2]))
        i_lo, i_hi = tl.split(tl.reshape(i, [1, i.shape[1] // 2, 2]))
        n_lo, n_hi = tl.split(tl.reshape(nan, [1, nan.shape[1] // 2, 2]))
        take_hi = v_hi > v_lo
        v = tl.where(take_hi, v_hi, v_lo)
        i = tl.where(take_hi, i_hi, i_lo)
        nan = n_lo | n_hi
    out = row * num_blocks + block + tl.arange(0, 1)
    tl.store(block_max_ptr + out, tl.reshape(v, [1]))
    tl.store(block_idx_ptr + out, tl.reshape(i, [1]))
    tl.store(block_nan_ptr + out, tl.reshape(nan, [1]))

def _log2(block: int) -> int:
    assert block > 0 and block & (block - 1) == 0, f"block {block} is not a power of two"
    return block.bit_length() - 1


def gumbel_block_argmax(x: Tensor, idx_mapping: Tensor, temperature: Tensor, seed: Tensor,
                        positions: Tensor, *, apply_temperature: bool, all_greedy: bool = False,
                        block: int = 4096) -> tuple[Tensor, Tensor, Tensor]:
    """Per (row, vocab block): the maximum of the noisy logits, the lowest token index
    reaching it and whether the block held a NaN (read as -inf); ``[B, num_blocks]`` float32,
    int32 and int8. ``all_greedy`` promises every row is greedy (no temperature is read)."""
    num_rows, vocab_size = x.shape
    assert x.stride(1) == 1, "logits rows must be contiguous"
    num_blocks = (vocab_size + block - 1) // block
    block_max = torch.empty(num_rows, num_blocks, dtype=torch.float32, device=x.device)
    block_idx = torch.empty(num_rows, num_blocks, dtype=torch.int32, device=x.device)
    block_nan = torch.empty(num_rows, num_blocks, dtype=torch.int8, device=x.device)
    if num_rows:
        triton_kernel(_gumbel_argmax_kernel, do_not_specialize=("x_stride",))[
            (num_rows, num_blocks)](
            x, x.stride(0), idx_mapping, temperature, seed, positions, block_max, block_idx,
            block_nan, num_blocks, vocab_size, APPLY_TEMPERATURE=apply_temperature,
            ALL_GREEDY=all_greedy, BLOCK=block, LOG2_BLOCK=_log2(block))
    return block_max, block_idx, block_nan


def _finish(block_max: Tensor, block_idx: Tensor, block_nan: Tensor) -> tuple[Tensor, Tensor]:
    best_block = block_max.argmax(dim=1, keepdim=True)  # first maximum: the lowest block
    return block_idx.gather(1, best_block).squeeze(1).long(), block_nan.amax(dim=1).bool()


def gumbel_sample(x: Tensor, idx_mapping: Tensor, temperature: Tensor, seed: Tensor,
                  positions: Tensor, *, apply_temperature: bool,
                  block: int = 4096) -> tuple[Tensor, Tensor]:
    """Sample one token per row of float32 ``x`` [B, V]; ``temperature`` and ``seed`` are the
    per-slot tables (read through ``idx_mapping``). With ``apply_temperature=False`` the caller
    has already divided ``x`` by the temperature. ``x`` is not modified. Returns the tokens
    ([B] int64) and which rows held a NaN ([B] bool; NaN never wins, an all-NaN row gives
    token 0)."""
    return _finish(*gumbel_block_argmax(x, idx_mapping, temperature, seed, positions,
                                        apply_temperature=apply_temperature, block=block))


def greedy_argmax(x: Tensor, idx_mapping: Tensor, *, block: int = 4096) -> tuple[Tensor, Tensor]:
    """Argmax of every row of ``x`` [B, V] (any float dtype), NaN read as -inf, ties to the
    lowest index; and which rows held a NaN. One pass, as ``torch.argmax``."""
    return _finish(*gumbel_block_argmax(x, idx_mapping, idx_mapping, idx_mapping, idx_mapping,
                                        apply_temperature=False, all_greedy=True, block=block))
