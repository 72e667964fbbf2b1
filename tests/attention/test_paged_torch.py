"""CPU paged attention vs a dense causal reference over the same (random) K/V."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.attention import Attention, AttentionMetadata, decode_numba
from mrv2.attention.paged_torch import paged_attention, write_kv


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [q_len, H, D] are the last q_len positions of a sequence with k/v [L, KV, D]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    rep = num_heads // num_kv_heads
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def _build_step(seq_lens: list[int], query_lens: list[int], block_size: int, num_blocks: int,
                gen: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step plus the flat slots of every cached-prefix token (all rows)."""
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    # Random, non-contiguous, disjoint block ids per request.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slot_rows, prefix_slots = [], []
    for row, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        n = -(-seq_len // block_size)
        tables[row, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
        pos = torch.arange(seq_len)
        slots = tables[row].long()[pos // block_size] * block_size + pos % block_size
        prefix_slots.append(slots[:seq_len - q_len])
        slot_rows.append(slots[seq_len - q_len:])
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    sl = np.array(seq_lens, dtype=np.int32)
    meta = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(seq_lens),
        num_decodes=_leading_ones(query_lens),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(sl),
        block_tables=tables, slot_mapping=torch.cat(slot_rows),
        query_start_loc_np=qsl, seq_lens_np=sl, max_seq_len=int(sl.max()))
    return meta, torch.cat(prefix_slots)


def _leading_ones(query_lens: list[int]) -> int:
    n = 0
    while n < len(query_lens) and query_lens[n] == 1:
        n += 1
    return n


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("numba_decode", [True, False])
def test_paged_attention_matches_dense(num_heads: int, num_kv_heads: int, block_size: int,
                                       numba_decode: bool, monkeypatch) -> None:
    if not numba_decode:  # the batched torch decode (any dtype other than float32 takes it)
        monkeypatch.setattr(decode_numba, "supported", lambda *args: False)
    gen = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads * 10 + block_size)
    head_dim, scale = 16, 16 ** -0.5
    # Decode rows first (query length 1, various cached lengths), then prefill chunks: one
    # with a cached prefix, one from scratch, one whose prefix ends mid-block.
    seq_lens = [1, 7, 19, 12, 9, 22]
    query_lens = [1, 1, 1, 5, 9, 3]
    meta, prefix_slots = _build_step(seq_lens, query_lens, block_size, num_blocks=40, gen=gen)
    assert meta.num_decodes == 3
    ks = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    qs = [torch.randn(n, num_heads, head_dim, generator=gen) for n in query_lens]
    # NaN in every slot that is never written (what a request whose logits were NaN leaves
    # in its freed blocks): it must never be read, not even with a zero weight.
    kv_cache = torch.full((2, 40, block_size, num_kv_heads, head_dim), float("nan"))
    # Earlier steps wrote the cached prefixes.
    write_kv(torch.cat([k[:s - n] for k, s, n in zip(ks, seq_lens, query_lens)]),
             torch.cat([v[:s - n] for v, s, n in zip(vs, seq_lens, query_lens)]),
             kv_cache, prefix_slots)
    # This step writes its own tokens, then attends.
    write_kv(torch.cat([k[s - n:] for k, s, n in zip(ks, seq_lens, query_lens)]),
             torch.cat([v[s - n:] for v, s, n in zip(vs, seq_lens, query_lens)]),
             kv_cache, meta.slot_mapping)
    out = paged_attention(torch.cat(qs), kv_cache, meta, scale)
    expected = torch.cat([_dense_reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_attention_module_flattens_heads() -> None:
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    seq_lens, query_lens = [5, 6], [1, 6]
    meta, prefix_slots = _build_step(seq_lens, query_lens, block_size, num_blocks=8, gen=gen)
    kv_cache = torch.zeros(2, 8, block_size, num_kv_heads, head_dim)
    k0 = torch.randn(4, num_kv_heads, head_dim, generator=gen)
    v0 = torch.randn(4, num_kv_heads, head_dim, generator=gen)
    write_kv(k0, v0, kv_cache, prefix_slots)
    q = torch.randn(7, num_heads * head_dim, generator=gen)
    k = torch.randn(7, num_kv_heads * head_dim, generator=gen)
    v = torch.randn(7, num_kv_heads * head_dim, generator=gen)
    attn = Attention(num_heads, head_dim, num_kv_heads, scale=head_dim ** -0.5)
    out = attn(q, k, v, kv_cache, meta)
    assert out.shape == (7, num_heads * head_dim)
    k3, v3 = k.view(7, num_kv_heads, head_dim), v.view(7, num_kv_heads, head_dim)
    ref0 = _dense_reference(q[:1].view(1, num_heads, head_dim), torch.cat([k0, k3[:1]]),
                            torch.cat([v0, v3[:1]]), attn.scale)
    ref1 = _dense_reference(q[1:].view(6, num_heads, head_dim), k3[1:], v3[1:], attn.scale)
    torch.testing.assert_close(out.view(7, num_heads, head_dim), torch.cat([ref0, ref1]),
                               atol=1e-5, rtol=1e-5)


def test_write_kv_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(2)
    kv_cache = torch.randn(2, 4, 4, 2, 8, generator=gen)
    before = kv_cache.clone()
    k = torch.randn(5, 2, 8, generator=gen)
    v = torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([13, -1, 2, -1, 7])
    write_kv(k, v, kv_cache, slots)
    flat_k, flat_v = kv_cache[0].view(16, 2, 8), kv_cache[1].view(16, 2, 8)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], k[i], rtol=0, atol=0)
            torch.testing.assert_close(flat_v[slot], v[i], rtol=0, atol=0)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[13, 2, 7]] = False
    assert torch.equal(flat_k[untouched], before[0].view(16, 2, 8)[untouched])
    assert torch.equal(flat_v[untouched], before[1].view(16, 2, 8)[untouched])


def test_write_kv_all_padding_is_a_no_op() -> None:
    kv_cache = torch.zeros(2, 2, 4, 1, 4)
    write_kv(torch.ones(3, 1, 4), torch.ones(3, 1, 4), kv_cache, torch.full((3,), -1))
    assert not kv_cache.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_few_tokens_by_numba_equal_the_torch_copies(dtype, monkeypatch) -> None:
    # Decode-sized writes run kv_numba's kernel, longer ones index_copy_: the same cache
    # either way, 16-bit caches rounded as torch rounds, strided v (a view of a fused qkv).
    from mrv2.attention import paged_torch

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 3 * 16, generator=gen) * 3
    k, v = qkv[:, 16:32].view(6, 2, 8), qkv[:, 32:].view(6, 2, 8)
    slots = torch.tensor([13, -1, 2, 40, -1, 7])
    caches = [torch.randn(2, 6, 8, 2, 8, generator=torch.Generator().manual_seed(4)).to(dtype)
              for _ in range(2)]
    write_kv(k, v, caches[0], slots)
    monkeypatch.setattr(paged_torch, "NUMBA_WRITE_MAX_TOKENS", 0)
    write_kv(k, v, caches[1], slots)
    assert torch.equal(caches[0].view(torch.int16) if dtype != torch.float32 else caches[0],
                       caches[1].view(torch.int16) if dtype != torch.float32 else caches[1])


def test_write_kv_slot_past_the_cache_raises() -> None:
    kv_cache = torch.zeros(2, 2, 4, 1, 4)
    with pytest.raises(IndexError):
        write_kv(torch.ones(2, 1, 4), torch.ones(2, 1, 4), kv_cache, torch.tensor([1, 8]))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens, calls", [
    ([1, 6, 6, 6], [3, 1]),  # side by side: one call of views, then the cached chunk
    ([1, 6, 9, 6, 9, 4], [2, 2, 1, 1]),  # two lengths gathered; the 4 and the chunk alone
    ([1, 6, 9, 4], [1, 1, 1, 1])])  # no two of a length: one call each
def test_whole_prompts_of_one_length_run_as_one_call_bit_for_bit(query_lens, calls,
                                                                  cache_dtype,
                                                                  monkeypatch) -> None:
    """Where prompt_numba's kernel does not run them (16-bit queries), a step's whole prompts
    of one length run as one SDPA call with the results of one call each, bit for bit (no
    padding: a prompt's values never depend on what else the step holds); a chunk with a
    cached prefix runs alone. A 16-bit cache: the step's own float32 k/v count as the cache
    holds them, rounded."""
    from mrv2.attention import paged_torch

    monkeypatch.setattr(paged_torch, "_prompt_kernel_takes", lambda q, kv_cache, scale: False)
    out, expected, batched, step = _whole_prompts_step(query_lens, cache_dtype, monkeypatch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert batched == calls
    monkeypatch.setattr(paged_torch, "_whole_prompts_at_once", lambda *args: args[6])
    assert torch.equal(paged_attention(*step), out)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("most, kernel, calls", [
    (1024, [6, 9, 6, 9, 4, 3], []),  # every prefill chunk in one kernel call
    (6, [6, 6, 4], [2, 1])])  # past the kernel's longest: the 9s as one SDPA call, the chunk
def test_float32_prefill_chunks_run_as_one_prompt_kernel_call(cache_dtype, most, kernel, calls,
                                                              monkeypatch) -> None:
    """Float32 queries: every prefill chunk of the step (whole prompts, and the chunk after a
    cached prefix) whose sequence holds up to prompt_numba.MAX_CONTEXT_TOKENS positions in one
    call of prompt_numba's kernel; longer ones on SDPA."""
    from mrv2.attention import prompt_numba

    monkeypatch.setattr(prompt_numba, "MAX_CONTEXT_TOKENS", most)
    kernel_calls = []
    real = prompt_numba.prompt_attention

    def spy(q, kv_cache, tables, starts, lengths, *args):
        kernel_calls.append(lengths.tolist())
        return real(q, kv_cache, tables, starts, lengths, *args)

    monkeypatch.setattr(prompt_numba, "prompt_attention", spy)
    out, expected, batched, _ = _whole_prompts_step([1, 6, 9, 6, 9, 4], cache_dtype,
                                                    monkeypatch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert kernel_calls == [kernel] and batched == calls


def _whole_prompts_step(query_lens: list[int], cache_dtype: torch.dtype, monkeypatch
                        ) -> tuple[torch.Tensor, torch.Tensor, list[int], tuple]:
    """A step of a decode row, whole prompts of `query_lens[1:]` tokens and a chunk of 3 after
    8 cached: (paged_attention's output, the reference, the batch sizes of its SDPA calls,
    paged_attention's arguments)."""
    from mrv2.attention import paged_torch

    gen = torch.Generator().manual_seed(len(query_lens))
    num_heads, num_kv_heads, head_dim, block_size, scale = 4, 2, 16, 4, 0.25
    seq_lens = [9] + query_lens[1:] + [11]  # the last row: 3 new tokens after 8 cached
    query_lens = query_lens + [3]
    meta, prefix_slots = _build_step(seq_lens, query_lens, block_size, num_blocks=64, gen=gen)
    ks = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    qs = [torch.randn(n, num_heads, head_dim, generator=gen) for n in query_lens]
    kv_cache = torch.full((2, 64, block_size, num_kv_heads, head_dim), float("nan"),
                          dtype=cache_dtype)
    write_kv(torch.cat([k[:s - n] for k, s, n in zip(ks, seq_lens, query_lens)]),
             torch.cat([v[:s - n] for v, s, n in zip(vs, seq_lens, query_lens)]),
             kv_cache, prefix_slots)
    k_new = torch.cat([k[s - n:] for k, s, n in zip(ks, seq_lens, query_lens)])
    v_new = torch.cat([v[s - n:] for v, s, n in zip(vs, seq_lens, query_lens)])
    write_kv(k_new, v_new, kv_cache, meta.slot_mapping)
    batched = []
    real = paged_torch.F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        batched.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(paged_torch.F, "scaled_dot_product_attention", spy)
    out = paged_attention(torch.cat(qs), kv_cache, meta, scale, k_new, v_new)
    expected = torch.cat([_dense_reference(q, k.to(cache_dtype).float(),
                                           v.to(cache_dtype).float(), scale)
                          for q, k, v in zip(qs, ks, vs)])
    monkeypatch.setattr(paged_torch.F, "scaled_dot_product_attention", real)
    return out, expected, batched, (torch.cat(qs), kv_cache, meta, scale, k_new, v_new)
