"""Attention variants on every kernel against a dense float64 reference: sliding windows (a
query at position p sees keys p - window + 1 .. p), soft caps (Gemma 2) and sink logits
(gpt-oss). The torch backend (numba decode rows, SDPA or eager prefill chunks with and without a
cached prefix), its torch decode fallback, batch-invariant mode's token-by-token path, the
numba kernel's context splits, and the Triton paged and split-KV kernels (interpreted)."""

from __future__ import annotations

import pytest
import torch

from mrv2 import batch_invariant, platform
from mrv2.attention import paged_torch
from mrv2.attention import paged_triton
from mrv2.attention import split_kv_triton
from tests.attention.test_paged_triton import SCALE, make_step

# Decode rows first (contexts longer and shorter than the windows), then prefill chunks with a
# cached prefix and one without.
MIXED = ([1, 1, 1, 5, 9], [3, 14, 22, 17, 9])
DECODE = ([1, 1, 1, 1], [2, 9, 23, 30])


def _reference(step, window: int, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense attention in float64 over each row's positions, causal and windowed, scores
    soft-capped, and a sink logit per head in each softmax (no value)."""
    cache = step.kv_cache.clone()
    paged_torch.write_kv(step.k, step.v, cache, step.meta.slot_mapping)
    meta, out = step.meta, torch.empty(step.q.shape, dtype=torch.float64)
    block_size = cache.shape[2]
    group = step.q.shape[1] // cache.shape[3]
    for row in range(meta.num_reqs):
        start, end = int(meta.query_start_loc_np[row]), int(meta.query_start_loc_np[row + 1])
        seq_len = int(meta.seq_lens_np[row])
        pos = torch.arange(seq_len)
        slots = meta.block_tables[row].long()[pos // block_size] * block_size + pos % block_size
        k = cache[0].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        v = cache[1].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        scores = torch.einsum("qhd,khd->hqk", step.q[start:end].double(), k) * SCALE
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~seen[None], float("-inf"))
        if sinks is not None:
            column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
            scores = torch.cat([scores, column], dim=-1)
        probs = scores.softmax(-1)[..., :seq_len]
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def _torch_backend(step, window: int, dtype: torch.dtype = torch.float32,
                   **variant) -> torch.Tensor:
    """The torch backend's output in `dtype` (`variant`: softcap=, sinks=)."""
    cache = step.kv_cache.clone().to(dtype)
    paged_torch.write_kv(step.k, step.v, cache, step.meta.slot_mapping)
    return paged_torch.paged_attention(step.q.to(dtype), cache, step.meta, SCALE,
                                       step.k.to(dtype), step.v.to(dtype), window=window,
                                       **variant)


@pytest.mark.parametrize("window", [1, 4, 7, 64])
@pytest.mark.parametrize("batch", [MIXED, DECODE], ids=["mixed", "decode"])
def test_torch_backend(window, batch):
    step = make_step(*batch, num_kv_heads=2, seed=window)
    ref = _reference(step, window)
    torch.testing.assert_close(_torch_backend(step, window).double(), ref, atol=2e-5, rtol=0)
    # float64 queries take the torch decode fallback instead of the numba kernel.
    torch.testing.assert_close(_torch_backend(step, window, torch.float64), ref, atol=1e-10,
                               rtol=0)
    try:
        batch_invariant.set_active(True)
        invariant = _torch_backend(step, window)
    finally:
        batch_invariant.set_active(False)
    torch.testing.assert_close(invariant.double(), ref, atol=2e-5, rtol=0)
    if window < 22:  # the window changed the answer: the test can fail
        assert not torch.allclose(_reference(step, 1 << 20), ref, atol=1e-3)


@pytest.mark.parametrize("window", [1, 5, 9])
@pytest.mark.parametrize("batch", [MIXED, DECODE], ids=["mixed", "decode"])
def test_triton_paged_attention(window, batch):
    step = make_step(*batch, num_kv_heads=2, seed=window)
    cache = step.kv_cache.clone()
    meta = step.meta
    with platform.triton_interpreter():
        paged_triton.write_kv(step.k, step.v, cache, meta.slot_mapping)
        out = paged_triton.paged_attention(step.q, cache, meta.query_start_loc, meta.seq_lens,
                                           meta.block_tables, SCALE, window=window, tile=4)
    torch.testing.assert_close(out.double(), _reference(step, window), atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [1, 6, 13])
def test_triton_split_kv(window):
    step = make_step(*DECODE, num_kv_heads=2, seed=window)
    cache = step.kv_cache.clone()
    meta = step.meta
    with platform.triton_interpreter():
        scratch = split_kv_triton.SplitKVScratch.allocate(
            4, step.q.shape[1], 4, step.q.shape[2], torch.device("cpu"))
        paged_triton.write_kv(step.k, step.v, cache, meta.slot_mapping)
        out = split_kv_triton.split_kv_decode(step.q, cache, meta.query_start_loc,
                                              meta.seq_lens, meta.block_tables, SCALE, scratch,
                                              tile=4, window=window)
    torch.testing.assert_close(out.double(), _reference(step, window), atol=2e-5, rtol=0)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("window", [3, 50, 130])
def test_numba_decode_kernel_context_splits(splits, window):
    """Long rows split over several work items: the window's first block starts the splits."""
    import numpy as np

    from mrv2.attention import decode_numba
    from mrv2.attention.kv_numba import numpy_view

    step = make_step([1, 1], [150, 260], num_kv_heads=2, seed=splits, num_blocks=120)
    cache = step.kv_cache.clone()
    paged_torch.write_kv(step.k, step.v, cache, step.meta.slot_mapping)
    out = torch.empty_like(step.q)
    decode_numba.decode_kernel(step.q.numpy(), numpy_view(cache[0]), numpy_view(cache[1]),
                               step.meta.block_tables.numpy(), step.meta.seq_lens_np,
                               np.float32(SCALE), out.numpy(), 1, splits, window,
                               np.float32(0.0), decode_numba.NO_SINKS)
    torch.testing.assert_close(out.double(), _reference(step, window), atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [0, 5])
def test_softcap_on_every_kernel(window):
    """Gemma 2's soft cap (scores -> cap * tanh(s / cap)), with and without a window."""
    step = make_step(*MIXED, num_kv_heads=2, seed=3)
    step.q.mul_(8.0)  # scores large enough for the cap to matter
    cap, full = 2.0, window or (1 << 20)
    ref = _reference(step, full, cap)
    assert not torch.allclose(ref, _reference(step, full), atol=1e-2)
    cache = step.kv_cache.clone()
    paged_torch.write_kv(step.k, step.v, cache, step.meta.slot_mapping)
    meta = step.meta
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-6)):  # float32 softmax
        out = _torch_backend(step, window, dtype, softcap=cap)
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    with platform.triton_interpreter():
        out = paged_triton.paged_attention(step.q, cache, meta.query_start_loc, meta.seq_lens,
                                           meta.block_tables, SCALE, window=window, tile=4,
                                           softcap=cap)
    torch.testing.assert_close(out.double(), ref, atol=5e-5, rtol=0)


@pytest.mark.parametrize("window", [0, 6])
def test_sinks_on_every_kernel(window):
    """gpt-oss's per-head sink logits: one more logit in each softmax, with no value; the
    split-KV kernel adds it once, at the merge."""
    step = make_step(*MIXED, num_kv_heads=2, seed=5)
    sinks = torch.tensor([0.5, 3.0, -1.0, 8.0])  # the last outweighs every key
    full = window or (1 << 20)
    ref = _reference(step, full, sinks=sinks)
    assert not torch.allclose(ref, _reference(step, full), atol=1e-2)
    cache = step.kv_cache.clone()
    paged_torch.write_kv(step.k, step.v, cache, step.meta.slot_mapping)
    meta = step.meta
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-6)):  # float32 softmax
        out = _torch_backend(step, window, dtype, sinks=sinks)
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    try:
        batch_invariant.set_active(True)
        out = paged_torch.paged_attention(step.q, cache, meta, SCALE, window=window,
                                          sinks=sinks)
    finally:
        batch_invariant.set_active(False)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    with platform.triton_interpreter():
        out = paged_triton.paged_attention(step.q, cache, meta.query_start_loc, meta.seq_lens,
                                           meta.block_tables, SCALE, window=window, tile=4,
                                           sinks=sinks)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
        decode = make_step(*DECODE, num_kv_heads=2, seed=6)
        decode_cache = decode.kv_cache.clone()
        paged_triton.write_kv(decode.k, decode.v, decode_cache, decode.meta.slot_mapping)
        scratch = split_kv_triton.SplitKVScratch.allocate(4, 4, 4, 16, torch.device("cpu"))
        out = split_kv_triton.split_kv_decode(
            decode.q, decode_cache, decode.meta.query_start_loc, decode.meta.seq_lens,
            decode.meta.block_tables, SCALE, scratch, tile=4, window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), _reference(decode, full, sinks=sinks), atol=2e-5,
                               rtol=0)


@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_in_the_numba_kernels_context_splits(splits):
    import numpy as np

    from mrv2.attention import decode_numba
    from mrv2.attention.kv_numba import numpy_view

    step = make_step([1, 1], [150, 260], num_kv_heads=2, seed=9, num_blocks=120)
    sinks = torch.tensor([1.0, -2.0, 4.0, 0.0])
    cache = step.kv_cache.clone()
    paged_torch.write_kv(step.k, step.v, cache, step.meta.slot_mapping)
    out = torch.empty_like(step.q)
    decode_numba.decode_kernel(step.q.numpy(), numpy_view(cache[0]), numpy_view(cache[1]),
                               step.meta.block_tables.numpy(), step.meta.seq_lens_np,
                               np.float32(SCALE), out.numpy(), 1, splits, 0, np.float32(0.0),
                               sinks.numpy())
    torch.testing.assert_close(out.double(), _reference(step, 1 << 20, sinks=sinks),
                               atol=2e-5, rtol=0)
