"""Causal attention of a step's prefill chunks (whole prompts, and chunks after a cached
prefix) over the paged KV cache: the CPU kernel for float32 queries (paged_torch.py calls it
once a step for all of them).

Work items are (chunk, kv head, block of `BLOCK_ROWS` queries): an item's queries are those of
the kv head's GQA group at the block's positions, and it reads the keys and values of the
positions up to the block's last one only (torch's float32 flash kernel reads a prompt's every
key for every query block below 512 keys: the causal half cost as much as the whole). It
copies them once from the cache's blocks into scratch laid out for
prompt_vector_ir.tile_product (keys transposed; a 16-bit cache widened to float32), computes
the scores as register tiles, the causal softmax in place (numba_exp.exp32), then the
probabilities times the values as register tiles, written to the output rows directly. Items
go to the threads in an order that pairs short blocks with long ones (`work_items`).

A chunk's result depends on its own queries and its sequence's keys and values only: the items
and every sum's order are fixed by its length and prefix, whatever else the step holds.

Numerics: float32; each score and each output element summed in one chain in order of the
head dimension and of the key positions; the softmax's exp is exp32 (2.5 ulp): results agree
with torch's SDPA to ~1e-6 relative.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from mrv2.attention.decode_vector_ir import vector_width
from mrv2.attention.kv_numba import numpy_view, widen
from mrv2.attention.prompt_vector_ir import TILE_ROWS, tile_product, tile_vectors
from mrv2.models.layers.numba_exp import exp32
from mrv2.models.layers.vector_ir import row_max, row_sum
from mrv2.utils.kernel_flags import FASTMATH

# Query positions per work item (times the GQA group: the rows of its tiles).
BLOCK_ROWS = 64
# Longest sequence (cached prefix + chunk) the kernel takes: its scratch holds a block's
# scores over every key, and past this torch's flash kernel, which skips the causal
# triangle's blocks from 512 keys on, ran whole prompts as fast or faster (bench/README.md,
# "prompt attention").
MAX_CONTEXT_TOKENS = 1024
# Runs of work items per thread (each allocates its scratch once).
CHUNKS_PER_THREAD = 4
# A tile's most vectors, its floats and columns (globals: numba compiles them in).
TILE_VECTORS = tile_vectors()
VECTOR_FLOATS = vector_width()
TILE_COLUMNS = TILE_VECTORS * VECTOR_FLOATS


@njit(inline="always", fastmath=FASTMATH, error_model="numpy", cache=True)
def _up(n, to):
    return (n + to - 1) // to * to


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def prompt_attention_kernel(q, k_cache, v_cache, tables, starts, lengths, prefixes, item_chunk,
                            item_block, block_rows, num_heads, chunks, scale, out):
    """out[t, h] = causal attention of query q[t, h] over its sequence's keys up to t's
    position, for every row t of every prefill chunk c: rows starts[c] .. starts[c] +
    lengths[c] - 1 of q and out ([T * num_heads, D], row t * num_heads + h), at positions
    prefixes[c] .. prefixes[c] + lengths[c] - 1 of a sequence whose keys and values the caches
    ([blocks, block_size, KV, D], float32 or 16-bit bits) hold in the blocks tables[c]. Items:
    (item_chunk[i], item_block[i]) x each kv head, split into `chunks` runs of consecutive
    items, each with its own scratch."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    items = item_chunk.shape[0] * num_kv_heads
    longest = _up((prefixes + lengths).max(), TILE_COLUMNS)
    most_rows = group * block_rows
    for chunk in prange(chunks):
        keys_t = np.empty((head_dim, longest), np.float32)  # keys transposed
        values = np.empty((longest, head_dim), np.float32)
        scores = np.empty((most_rows, longest), np.float32)
        factors = np.empty(most_rows, np.float32)  # 1 / each row's exp-sum
        query_rows = np.empty(most_rows, np.int64)  # each row's row of q and of out
        own_rows = np.arange(most_rows)
        ones = np.ones(most_rows, np.float32)
        for item in range(chunk * items // chunks, (chunk + 1) * items // chunks):
            kv = item % num_kv_heads
            c = item_chunk[item // num_kv_heads]
            first = item_block[item // num_kv_heads] * block_rows  # the block's first query
            start, prefix = starts[c], prefixes[c]
            stop = min(lengths[c], first + block_rows)  # past its last query
            positions = stop - first
            keys = prefix + stop  # the keys its queries see: positions 0 .. keys - 1
            rows = group * positions  # row g * positions + r: head g at query first + r
            for j in range(keys):
                block, at = tables[c, j // block_size], j % block_size
                for d in range(head_dim):
                    keys_t[d, j] = widen(k_cache[block, at, kv, d])
                    values[j, d] = widen(v_cache[block, at, kv, d])
            for g in range(group):
                for r in range(positions):
                    query_rows[g * positions + r] = ((start + first + r) * num_heads
                                                     + kv * group + g)
            for m0 in range(0, rows, TILE_ROWS):
                n = min(TILE_ROWS, rows - m0)
                seen = prefix + _tile_queries(m0, n, positions, first, stop)
                for n0 in range(0, seen, TILE_COLUMNS):
                    tile_product(q, query_rows, keys_t, scores, own_rows, ones, m0, n,
                                 n0, TILE_VECTORS, head_dim)
            for row in range(rows):
                seen = prefix + first + row % positions + 1
                most = row_max(scores, row, seen)
                # Whole vectors of exps (a scalar tail cost more than the row's vectors; the
                # scratch past `seen` is then zeroed, whatever it held).
                for j in range(_up(seen, VECTOR_FLOATS)):
                    scores[row, j] = exp32((scores[row, j] - most) * scale)
                for j in range(seen, keys):
                    scores[row, j] = 0.0
                factors[row] = np.float32(1.0) / row_sum(scores, row, seen)
            for m0 in range(0, rows, TILE_ROWS):
                n = min(TILE_ROWS, rows - m0)
                seen = prefix + _tile_queries(m0, n, positions, first, stop)
                for n0 in range(0, head_dim, TILE_COLUMNS):
                    vectors = min(TILE_VECTORS, (head_dim - n0) // VECTOR_FLOATS)
                    tile_product(scores, own_rows, values, out, query_rows, factors, m0, n, n0,
                                 vectors, seen)


@njit(inline="always", cache=True)
def _tile_queries(m0, n, positions, first, stop):
    """Queries of the chunk up to the last one the tile of rows m0 .. m0 + n - 1 holds (its
    last row's, or the block's last when the tile spans two heads: the later head's queries
    restart at the block's first)."""
    last = m0 + n - 1
    if m0 // positions != last // positions:
        return stop
    return first + last % positions + 1


def work_items(lengths: np.ndarray, block_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunk, block) of every block of every chunk, ordered so that each half of the list
    (numba's parallel loop gives each thread a contiguous range) holds short and long blocks
    alike: the i-th and the i-th from last alternate."""
    blocks = -(-lengths.astype(np.int64) // block_rows)
    prompt = np.repeat(np.arange(lengths.size, dtype=np.int64), blocks)
    block = np.arange(prompt.size, dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks,
                                                               blocks)
    n = prompt.size
    order = np.empty(n, np.int64)
    order[0::2] = np.arange((n + 1) // 2)
    order[1::2] = n - 1 - np.arange(n // 2)
    return prompt[order], block[order]


def prompt_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     starts: np.ndarray, lengths: np.ndarray, prefixes: np.ndarray,
                     scale: float, out: torch.Tensor) -> None:
    """Causal attention of prefill chunks into `out`: q [T, H, D] float32 CPU; chunk i's
    queries at rows starts[i] .. starts[i] + lengths[i] - 1, after prefixes[i] cached
    positions, its keys and values (the chunk's own included: written before) in kv_cache [2,
    blocks, block_size, KV, D] (float32 or 16-bit, contiguous; D a whole number of vectors:
    decode_vector_ir.takes_head_dim) at the blocks block_tables[i]; out [T, H, D] float32
    (contiguous) gets those rows, the others are not written. `scale` > 0."""
    if not out.is_contiguous():
        raise ValueError("prompt_attention writes a contiguous out")
    if lengths.size == 0:
        return
    chunk, block = work_items(lengths, BLOCK_ROWS)
    items = chunk.size * kv_cache.shape[3]
    chunks = min(items, CHUNKS_PER_THREAD * numba.get_num_threads())
    prompt_attention_kernel(_contiguous_numpy(q).reshape(-1, q.shape[2]),
                            numpy_view(kv_cache[0]), numpy_view(kv_cache[1]),
                            block_tables.numpy(), starts.astype(np.int64),
                            lengths.astype(np.int64), prefixes.astype(np.int64), chunk, block,
                            BLOCK_ROWS, q.shape[1], chunks, np.float32(scale),
                            out.view(-1, out.shape[2]).numpy())


def _contiguous_numpy(t: torch.Tensor) -> np.ndarray:
    """A [T, N, D] tensor as numpy, contiguous (copied only where it is not)."""
    return t.detach().contiguous().numpy()
