"""The numba decode-attention kernel against a dense reference over the same paged K/V."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from numba import njit

from mrv2.attention import decode_numba, decode_vector_ir


def _paged_case(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max(-(-s // block_size) for s in seq_lens))
    num_blocks = len(seq_lens) * max_blocks + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # Disjoint, shuffled block ids: the kernel must follow the table, not assume contiguity.
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).int()
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    return q, kv_cache, tables, np.array(seq_lens, dtype=np.int32)


def _reference(q, kv_cache, tables, seq_lens, scale):
    rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros(rows, num_heads, head_dim, dtype=torch.float64)
    for row in range(rows):
        n = int(seq_lens[row])
        if n == 0:
            continue
        pos = torch.arange(n)
        blocks = tables[row].long()[pos // block_size]
        k = kv_cache[0][blocks, pos % block_size].double()  # [n, KV, D]
        v = kv_cache[1][blocks, pos % block_size].double()
        rep = num_heads // num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].double(), k) * scale
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out.float()


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [32, 12])
def test_matches_dense_reference(num_heads, num_kv_heads, block_size, head_dim):
    """Head sizes of whole vectors take decode_vector_ir's loops, 12 the numba loops."""
    assert decode_vector_ir.takes_head_dim(head_dim) == (head_dim == 32)
    assert decode_numba.VECTOR_WIDTH == decode_vector_ir.vector_width()
    seq_lens = [1, 5, 16, 17, 40, 3]
    q, kv_cache, tables, lens = _paged_case(seq_lens, num_heads, num_kv_heads, head_dim,
                                            block_size, seed=num_heads * 31 + block_size)
    scale = head_dim ** -0.5
    got = decode_numba.decode_attention(q, kv_cache, tables, lens, scale)
    torch.testing.assert_close(got, _reference(q, kv_cache, tables, lens, scale),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_per_item, splits", [(1, 1), (2, 1), (1, 3), (2, 2)])
@pytest.mark.parametrize("head_dim", [32, 12])
def test_every_work_split_gives_the_reference(kv_per_item, splits, head_dim):
    """Items of one or all kv heads, contexts whole or split (flash-decoding, merged): rows
    that fill every split, fewer blocks than splits (empty splits), padding, and lengths that
    end inside a four-position pass; in the vector loops and the numba loops."""
    seq_lens = [1, 70, 203, 0, 130]
    q, kv_cache, tables, lens = _paged_case(seq_lens, 6, 2, head_dim, 16, seed=11 + splits)
    out = torch.full_like(q, float("nan"))
    decode_numba.decode_kernel(q.numpy(), kv_cache[0].numpy(), kv_cache[1].numpy(),
                               tables.numpy(), lens, np.float32(0.2), out.numpy(),
                               kv_per_item, splits, *decode_numba.PLAIN_ATTENTION)
    torch.testing.assert_close(out, _reference(q, kv_cache, tables, lens, 0.2),
                               rtol=1e-5, atol=1e-5)


def test_work_split_gives_every_thread_two_items(monkeypatch):
    monkeypatch.setattr(decode_numba.platform, "last_level_cache_bytes", lambda: 1 << 20)
    monkeypatch.setattr(decode_numba, "WHOLE_ROW_ITEMS", True)
    from_dram = 2 << 20
    assert decode_numba.work_split(4, 3, 2, from_dram) == (3, 1)
    assert decode_numba.work_split(4, 3, 2, 1 << 19) == (1, 1)  # the cache holds the K/V
    for kv_bytes in (1 << 19, from_dram):  # too few rows for whole-row items either way
        assert decode_numba.work_split(2, 3, 2, kv_bytes) == (1, 1)
        assert decode_numba.work_split(1, 3, 2, kv_bytes) == (1, 2)
        assert decode_numba.work_split(1, 1, 2, kv_bytes) == (1, 4)
        assert decode_numba.work_split(3, 5, 16, kv_bytes) == (1, 3)


def test_no_whole_row_items_on_a_cpu_without_them(monkeypatch):
    """AVX-512 CPUs: (row, kv head) items wherever the K/V lies."""
    monkeypatch.setattr(decode_numba.platform, "last_level_cache_bytes", lambda: 1 << 20)
    monkeypatch.setattr(decode_numba, "WHOLE_ROW_ITEMS", False)
    assert decode_numba.work_split(4, 3, 2, 2 << 20) == (1, 1)
    assert decode_numba.work_split(32, 8, 2, 200 << 20) == (1, 1)


def test_step_kv_bytes_counts_keys_and_values_of_every_layer():
    lens = np.array([3, 0, 5], np.int32)
    assert decode_numba.step_kv_bytes(lens, num_kv_heads=3, head_dim=64, itemsize=2,
                                      layers=30) == 8 * 2 * 3 * 64 * 2 * 30


def test_padding_rows_are_zero_and_extra_table_rows_are_ignored():
    q, kv_cache, tables, lens = _paged_case([7, 0, 12], 4, 2, 16, 4, seed=3)
    # The table may have more rows than q (a persistent buffer): only q's rows are read.
    tables = torch.cat([tables, torch.full((5, tables.shape[1]), 10**6, dtype=torch.int32)])
    got = decode_numba.decode_attention(q, kv_cache, tables, np.append(lens, [9] * 5), 0.25)
    assert torch.all(got[1] == 0)
    ref = _reference(q, kv_cache, tables[:3], lens, 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert decode_numba.decode_attention(q[:0], kv_cache, tables, lens, 0.25).shape == (0, 4, 16)


# bfloat16 only: float16 differs in the element's widening alone (test_kv_numba.py), and each
# cache type compiles the kernel again (~8 s of CI).
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_16_bit_caches_read_as_their_float32_values(dtype):
    """A 16-bit cache is widened exactly: the result of the float32 copy of its values, to the
    last few bits (the kernel compiled for each element type may vectorise its sums in another
    order: 62 of 1536 outputs differed by up to 2 ulp in one CI run, none in others)."""
    q, kv_cache, tables, lens = _paged_case([1, 9, 33, 20], 6, 2, 64, 16, seed=5)
    cache = kv_cache.to(dtype)
    got = decode_numba.decode_attention(q, cache, tables, lens, 0.125)
    torch.testing.assert_close(got, decode_numba.decode_attention(q, cache.float(), tables,
                                                                  lens, 0.125),
                               rtol=1e-6, atol=1e-7)


def test_supported_only_for_float32_queries_and_contiguous_caches():
    q = torch.zeros(1, 2, 4)
    cache = torch.zeros(2, 3, 4, 2, 4)
    assert decode_numba.supported(q, cache)
    assert decode_numba.supported(q, cache.half()) and decode_numba.supported(q, cache.bfloat16())
    assert not decode_numba.supported(q.half(), cache)
    assert not decode_numba.supported(q, cache.double())
    assert not decode_numba.supported(q, cache.transpose(1, 2))


@njit
def _prefetch_a_block(cache, block, row_bytes):
    """decode_numba's prefetch of one block's rows, compiled here (its own compiled code is
    cached, and numba cannot show a cached function's IR)."""
    decode_numba._prefetch_rows(cache, block, 0, cache.shape[1], row_bytes, 0, row_bytes)


def test_the_blocks_ahead_are_prefetched_into_l2():
    """The K/V stream from DRAM overlaps the compute only when its prefetches stop at L2
    (prefetch_numba.prefetch_to_l2_at: LLVM locality 2); locality 3 (into L1) was far slower
    there (bench/test_model_layers.py::test_decode_attention_prefetch_level)."""
    cache = np.zeros((3, 16, 2, 64), np.uint16)
    _prefetch_a_block(cache, np.int64(1), 2 * 64 * 2)
    ir = next(iter(_prefetch_a_block.inspect_llvm().values()))
    levels = re.findall(r"call void @llvm\.prefetch\.p0\(ptr [^,]+, i32 0, i32 (\d), i32 1\)", ir)
    assert levels and set(levels) == {"2"}


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_the_running_thread_count_does_not_change_the_output(cache_dtype):
    """The split is planned for numba's pool (`planned_threads`), not the count free_cores
    fits to the machine's load: batch 1 (where the context splits) gives the same bits at 1
    and 2 threads."""
    import numba

    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 40, 16, 3, 64, generator=g).to(cache_dtype)
    tables = torch.randperm(40, generator=g).to(torch.int32).reshape(1, 40)
    q = torch.randn(1, 9, 64, generator=g)
    lens = np.array([600], np.int32)
    before = numba.get_num_threads()
    outs = []
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            outs.append(decode_numba.decode_attention(q, kv, tables, lens, 0.125))
    finally:
        numba.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    assert decode_numba.work_split(1, 3, decode_numba.planned_threads(), 0)[1] > 1 or (
        numba.config.NUMBA_NUM_THREADS == 1)


def test_verify_rows_of_one_request_are_summed_as_its_one_decode_row():
    """Speculative decoding splits a request's verify step into decode rows at consecutive
    positions; with `sequences` (their one request) the work split is the request's, so each
    row's output has the bits that row would have alone (a batch-1 step splits the context
    over the threads, a 3-row step would not)."""
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 40, 16, 3, 64, generator=g)
    table = torch.randperm(40, generator=g).to(torch.int32).reshape(1, 40)
    q = torch.randn(3, 9, 64, generator=g)
    lens = np.array([500, 501, 502], np.int32)
    together = decode_numba.decode_attention(q, kv, table.expand(3, 40), lens, 0.125,
                                             sequences=1)
    for row in range(3):
        alone = decode_numba.decode_attention(q[row:row + 1], kv, table, lens[row:row + 1],
                                              0.125)
        assert torch.equal(together[row], alone[0])
    threads = decode_numba.planned_threads()
    if threads > 1:  # the rows alone would be split otherwise
        assert decode_numba.work_split(3, 3, threads, 0) != decode_numba.work_split(
            1, 3, threads, 0)
