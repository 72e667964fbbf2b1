"""The KV cache's elements as the numba kernels see them (decode_numba.py's attention, the
KV write below): float32, or 16-bit bit patterns, since numpy has no bfloat16.

A float16 cache reaches numba as int16 and a bfloat16 cache as uint16 (`numpy_view`), so the
element type picks the conversion when a kernel compiles: `widen` turns an element into float32
(exact for both 16-bit types), `store` narrows a float32 into a cache element (round to nearest,
ties to even, as torch's `.to()` rounds). A float32 cache is read and written as is.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, types
from numba.extending import overload

from mrv2.models.layers.vector_ir import (bf16_bits_to_float, f16_bits_to_float,
                                          float_to_bf16_bits, float_to_f16_bits, half_bits)
from mrv2.utils.kernel_flags import FASTMATH

# The cache dtypes the numba kernels read and write.
NUMBA_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def numpy_view(cache: torch.Tensor) -> np.ndarray:
    """A CPU cache tensor (or a slice of one) as the array the kernels take, sharing memory."""
    if cache.dtype == torch.float32:
        return cache.numpy()
    if cache.dtype in (torch.float16, torch.bfloat16):
        return half_bits(cache)
    raise TypeError(f"no numba view of a {cache.dtype} KV cache")


def widen(element):
    """A cache element as float32 (numba only: see the overload)."""
    raise NotImplementedError("numba only")


@overload(widen, inline="always")
def _widen_overload(element):
    if element == types.float32:
        return lambda element: element
    if element == types.int16:
        return lambda element: f16_bits_to_float(element)
    if element == types.uint16:
        return lambda element: bf16_bits_to_float(element)
    return None


def store(cache, block, offset, head, dim, value):
    """cache[block, offset, head, dim] = value (float32), narrowed to the cache's element
    (numba only: see the overload)."""
    raise NotImplementedError("numba only")


@overload(store, inline="always")
def _store_overload(cache, block, offset, head, dim, value):
    if cache.dtype == types.float32:
        def store_float32(cache, block, offset, head, dim, value):
            cache[block, offset, head, dim] = value
        return store_float32
    if cache.dtype == types.int16:
        def store_float16(cache, block, offset, head, dim, value):
            cache[block, offset, head, dim] = float_to_f16_bits(np.float32(value))
        return store_float16
    if cache.dtype == types.uint16:
        def store_bfloat16(cache, block, offset, head, dim, value):
            cache[block, offset, head, dim] = float_to_bf16_bits(np.float32(value))
        return store_bfloat16
    return None


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def write_kv_kernel(k, v, k_cache, v_cache, slots):
    """k/v [T, KV*D] (rows may be strided) into the flat cache slots, each element narrowed
    by `store` (slot < 0: padding, skipped; a slot past the cache raises IndexError, as
    index_copy_ would, instead of writing out of bounds). The fused decode stack's KV write,
    and paged_torch.write_kv's for a decode step's few tokens."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_slots = k_cache.shape[0] * block_size
    for t in range(k.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        if slot >= num_slots:
            raise IndexError("KV write: a slot past the end of the cache")
        block, offset = slot // block_size, slot % block_size
        for h in range(num_kv_heads):
            for d in range(head_dim):
                store(k_cache, block, offset, h, d, k[t, h * head_dim + d])
                store(v_cache, block, offset, h, d, v[t, h * head_dim + d])
