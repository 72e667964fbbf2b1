"""Causal attention of whole prompts (no cached prefix) over the step's own keys and values:
the CPU kernel for float32 (paged_torch.py calls it for a step's whole prompts).

Work items are (prompt, kv head, block of `BLOCK_ROWS` query positions): an item's queries
are those of the kv head's GQA group at the block's positions, and it reads the keys and
values of the positions up to the block's last one only (torch's float32 flash kernel reads a
prompt's every key for every query block below 512 keys: the causal half cost as much as the
whole). It copies them once into scratch laid out for prompt_vector_ir.tile_product (keys
transposed, rows padded to whole tiles), computes the scores as register tiles, the causal
softmax in place (numba_exp.exp32), then the probabilities times the values as register
tiles. Items go to the threads in an order that pairs short blocks with long ones
(`work_items`).

A prompt's result depends on its own queries, keys and values only: the items and every sum's
order are fixed by its length, whatever else the step holds (the whole-prompt batching's
invariant, paged_torch.py).

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
from mrv2.attention.prompt_vector_ir import TILE_ROWS, tile_product, tile_vectors
from mrv2.models.layers.numba_exp import exp32
from mrv2.models.layers.vector_ir import row_max, row_sum
from mrv2.utils.kernel_flags import FASTMATH

# Query positions per work item (times the GQA group: the rows of its tiles).
BLOCK_ROWS = 64
# Longest prompt the kernel takes: its scratch holds a block's scores over every key, and past
# this torch's flash kernel, which skips the causal triangle's blocks from 512 keys on, ran as
# fast or faster (bench/README.md, "prompt attention").
MAX_PROMPT_TOKENS = 1024
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
def prompt_attention_kernel(q, k, v, starts, lengths, item_prompt, item_block, block_rows,
                            chunks, scale, out):
    """out[t, h] = causal attention of query q[t, h] over its prompt's keys up to t, for every
    row t of every prompt p: rows starts[p] .. starts[p] + lengths[p] - 1 of q and out ([T * H,
    D], row t * H + h) and of k and v ([T, KV, D]). Items: (item_prompt[i], item_block[i]) x
    each kv head, split into `chunks` runs of consecutive items, each with its own scratch."""
    head_dim = k.shape[2]
    num_kv_heads = k.shape[1]
    num_heads = q.shape[0] // k.shape[0]
    group = num_heads // num_kv_heads
    items = item_prompt.shape[0] * num_kv_heads
    longest = _up(lengths.max(), TILE_COLUMNS)
    most_rows = group * block_rows
    for chunk in prange(chunks):
        keys_t = np.empty((head_dim, longest), np.float32)  # keys transposed
        scores = np.empty((most_rows, longest), np.float32)
        factors = np.empty(most_rows, np.float32)  # 1 / each row's exp-sum
        query_rows = np.empty(most_rows, np.int64)  # each row's row of q and of out
        own_rows = np.arange(most_rows)
        ones = np.ones(most_rows, np.float32)
        for item in range(chunk * items // chunks, (chunk + 1) * items // chunks):
            kv = item % num_kv_heads
            prompt = item_prompt[item // num_kv_heads]
            first = item_block[item // num_kv_heads] * block_rows  # the block's first position
            start = starts[prompt]
            stop = min(lengths[prompt], first + block_rows)  # past its last position
            positions = stop - first
            rows = group * positions  # row g * positions + r: head g at position first + r
            for j in range(stop):
                for d in range(head_dim):
                    keys_t[d, j] = k[start + j, kv, d]
            for g in range(group):
                for r in range(positions):
                    query_rows[g * positions + r] = ((start + first + r) * num_heads
                                                     + kv * group + g)
            for m0 in range(0, rows, TILE_ROWS):
                n = min(TILE_ROWS, rows - m0)
                seen = _tile_keys(m0, n, positions, first, stop)
                for n0 in range(0, seen, TILE_COLUMNS):
                    tile_product(q, query_rows, keys_t, scores, own_rows, ones, m0, n,
                                 n0, TILE_VECTORS, head_dim)
            for row in range(rows):
                seen = first + row % positions + 1
                most = row_max(scores, row, seen)
                # Whole vectors of exps (a scalar tail cost more than the row's vectors; the
                # scratch past `seen` is then zeroed, whatever it held).
                for j in range(_up(seen, VECTOR_FLOATS)):
                    scores[row, j] = exp32((scores[row, j] - most) * scale)
                for j in range(seen, stop):
                    scores[row, j] = 0.0
                factors[row] = np.float32(1.0) / row_sum(scores, row, seen)
            values = v[start:start + stop, kv, :]
            for m0 in range(0, rows, TILE_ROWS):
                n = min(TILE_ROWS, rows - m0)
                seen = _tile_keys(m0, n, positions, first, stop)
                for n0 in range(0, head_dim, TILE_COLUMNS):
                    vectors = min(TILE_VECTORS, (head_dim - n0) // VECTOR_FLOATS)
                    tile_product(scores, own_rows, values, out, query_rows, factors, m0, n, n0,
                                 vectors, seen)


@njit(inline="always", cache=True)
def _tile_keys(m0, n, positions, first, stop):
    """Keys the tile of rows m0 .. m0 + n - 1 sees: up to its last row's position, or all
    the block's when it spans two heads (the later head's positions restart)."""
    last = m0 + n - 1
    if m0 // positions != last // positions:
        return stop
    return first + last % positions + 1


def work_items(lengths: np.ndarray, block_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, block) of every block of every prompt, ordered so that each half of the list
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


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: np.ndarray,
                     lengths: np.ndarray, scale: float, out: torch.Tensor) -> None:
    """Causal attention of whole prompts into `out`: q [T, H, D], k and v [T, KV, D] float32
    CPU (D a whole number of vectors: decode_vector_ir.takes_head_dim), the prompts at rows
    starts[i] .. starts[i] + lengths[i] - 1; out [T, H, D] float32 (contiguous) gets those
    rows, the others are not written. `scale` > 0."""
    if not out.is_contiguous():
        raise ValueError("prompt_attention writes a contiguous out")
    if lengths.size == 0:
        return
    prompt, block = work_items(lengths, BLOCK_ROWS)
    items = prompt.size * k.shape[1]
    chunks = min(items, CHUNKS_PER_THREAD * numba.get_num_threads())
    prompt_attention_kernel(_contiguous_numpy(q).reshape(-1, q.shape[2]),
                            _contiguous_numpy(k), _contiguous_numpy(v),
                            starts.astype(np.int64), lengths.astype(np.int64), prompt, block,
                            BLOCK_ROWS, chunks, np.float32(scale),
                            out.view(-1, out.shape[2]).numpy())


def _contiguous_numpy(t: torch.Tensor) -> np.ndarray:
    """A [T, N, D] tensor as numpy, contiguous (copied only where it is not)."""
    return t.detach().contiguous().numpy()
