"""Attention over the paged KV cache in plain torch: the CPU backend.

Decode rows (one query token) are batched. With float32 queries they run the numba kernel
(`decode_numba`), which reads the cache (float32 or 16-bit) in place; otherwise their blocks
are gathered into one padded `[rows, max_seq_len]` key/value tensor and masked by seq_len.
A step's prefill chunks with float32 queries (whole prompts and chunks after a cached
prefix, up to prompt_numba.MAX_CONTEXT_TOKENS positions) run prompt_numba's kernel over the
cache, all in one call (`_chunks_numba`). Other prefill chunks run one
`scaled_dot_product_attention` each (whole prompts of one length, with 16-bit queries, one
batched call: `_whole_prompts_at_once`), attending to the cached prefix
plus their own tokens causally: query i of a chunk of length q in a sequence of length L
sits at position L - q + i and sees keys 0 .. L - q + i. A chunk with no cached prefix
(q == L) attends to the step's own k/v when the caller passes them: the same values the
cache now holds, without the gather. With a sliding window (`window` > 0) each query also
stops seeing keys `window` or more positions behind it. With a soft cap (`softcap` > 0,
Gemma 2) scores become softcap * tanh(s / softcap) before the softmax: prefill chunks then run
the attention as transformers' eager path writes it (SDPA has no cap), as they do with sink
logits (`sinks` [H], gpt-oss: one more logit per head in each softmax, with no value). In
batch-invariant mode
every token, prefill too, runs the numba decode kernel (`_token_by_token`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mrv2 import batch_invariant
from mrv2.attention import decode_numba, decode_vector_ir, kv_numba, prompt_numba
from mrv2.attention.backend import AttentionMetadata


# Tokens up to which a float32 write runs kv_numba's serial kernel: one call where index_copy_
# took a min, two casts and two copies (a decode step's few rows); longer writes (prefill)
# take torch's parallel copies.
NUMBA_WRITE_MAX_TOKENS = 64


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, KV, D] at flat slots; slots < 0 (padding) are skipped."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    tokens = k.shape[0]
    if (0 < tokens <= NUMBA_WRITE_MAX_TOKENS and k.dtype == v.dtype == torch.float32
            and k.device.type == "cpu" and kv_cache.dtype in kv_numba.NUMBA_KV_DTYPES
            and kv_cache.is_contiguous()):
        kv_numba.write_kv_kernel(
            k.detach().reshape(tokens, -1).numpy(), v.detach().reshape(tokens, -1).numpy(),
            kv_numba.numpy_view(kv_cache[0]), kv_numba.numpy_view(kv_cache[1]),
            slot_mapping.numpy())
        return
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k: torch.Tensor | None = None,
                    v: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D]; K/V for the step must already be in the cache. `k`/`v`
    [T, KV, D], when given, are this step's keys/values (as written to the cache). `window`:
    the sliding window (0: none); `softcap`: the scores' soft cap (0: none); `sinks`: the
    heads' sink logits (None: none)."""
    if batch_invariant.active() and decode_numba.supported(q, kv_cache):
        return _token_by_token(q, kv_cache, meta, scale, window, softcap, sinks)
    out = torch.empty_like(q)
    if meta.num_decodes:
        nd = meta.num_decodes
        if decode_numba.supported(q, kv_cache):
            out[:nd] = decode_numba.decode_attention(q[:nd], kv_cache, meta.block_tables,
                                                     meta.seq_lens_np, scale, meta.num_layers,
                                                     window, softcap, sinks,
                                                     meta.decode_sequences)
        else:
            out[:nd] = _decode_attention(q[:nd], kv_cache, meta, scale, window, softcap, sinks)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_size = k_cache.shape[1]
    qsl = meta.query_start_loc_np
    rows = np.arange(meta.num_decodes, meta.num_reqs)  # the prefill chunks
    if (rows.size and softcap <= 0.0 and sinks is None
            and _prompt_kernel_takes(q, kv_cache, scale)):
        rows = _chunks_numba(q, kv_cache, meta, rows, scale, window, out)
    # The step's own k/v, rounded to the cache's dtype as the write rounded them: what the
    # cache now holds (cast only where a chunk reads them: not in a decode-only step).
    own_kv = k is not None and v is not None and rows.size > 0
    if own_kv and k.dtype != kv_cache.dtype:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if own_kv and softcap <= 0.0 and sinks is None and rows.size > 1:
        rows = _whole_prompts_at_once(q, k, v, out, qsl, meta.seq_lens_np, rows, scale, window)
    for row in rows.tolist():
        start, end = int(qsl[row]), int(qsl[row + 1])
        query_len, seq_len = end - start, int(meta.seq_lens_np[row])
        qi = q[start:end].transpose(0, 1)  # [H, q, D]
        if query_len == seq_len and own_kv:
            o = _sdpa(qi, k[start:end].transpose(0, 1).to(q.dtype),
                      v[start:end].transpose(0, 1).to(q.dtype), scale,
                      _window_mask(query_len, seq_len, window, q.device), softcap, sinks)
            out[start:end] = o.transpose(0, 1)
            continue
        num_blocks = -(-seq_len // block_size)
        # With a window, from the block of the first key the chunk sees: the blocks before
        # it may be given back (core/kv_cache_manager.py) and hold another request's K/V.
        first = max(seq_len - query_len - window + 1, 0) // block_size if window > 0 else 0
        block_ids = meta.block_tables[row, first:num_blocks].long()
        key_start = first * block_size
        # [KV, L, D] in q's dtype (a 16-bit cache under a float32 model is widened here).
        kr = k_cache[block_ids].flatten(0, 1)[:seq_len - key_start].transpose(0, 1).to(q.dtype)
        vr = v_cache[block_ids].flatten(0, 1)[:seq_len - key_start].transpose(0, 1).to(q.dtype)
        mask = _window_mask(query_len, seq_len, window, q.device, key_start)
        out[start:end] = _sdpa(qi, kr, vr, scale, mask, softcap, sinks).transpose(0, 1)
    return out


def _prompt_kernel_takes(q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> bool:
    """prompt_numba's kernel runs the prefill chunks: float32 CPU queries of a head size it
    takes over a cache the numba kernels read."""
    return (decode_numba.supported(q, kv_cache) and scale > 0.0
            and decode_vector_ir.takes_head_dim(q.shape[-1]))


def _chunks_numba(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                  rows: np.ndarray, scale: float, window: int, out: torch.Tensor) -> np.ndarray:
    """The prefill chunks among `rows` whose sequences hold up to
    prompt_numba.MAX_CONTEXT_TOKENS positions (and fit the window, if any) in one
    prompt_numba call into `out`; returns the rows left. Each chunk's result is its own: the
    kernel's work and sums depend on its length and prefix only."""
    qsl = meta.query_start_loc_np
    seq_lens = meta.seq_lens_np[rows].astype(np.int64)
    taken = seq_lens <= prompt_numba.MAX_CONTEXT_TOKENS
    if window > 0:
        taken &= seq_lens <= window
    if taken.any():
        chunks = rows[taken]
        lengths = (qsl[chunks + 1] - qsl[chunks]).astype(np.int64)
        prompt_numba.prompt_attention(q, kv_cache, meta.block_tables[torch.from_numpy(chunks)],
                                      qsl[chunks], lengths, seq_lens[taken] - lengths, scale,
                                      out)
    return rows[~taken]


def _whole_prompts_at_once(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           qsl: np.ndarray, seq_lens: np.ndarray, rows: np.ndarray, scale: float,
                           window: int) -> np.ndarray:
    """The step's whole prompts (no cached prefix; k/v the step's own) among `rows`, those of
    one length as one batched SDPA each, into `out` (views of the step's tokens where they
    sit side by side, else gathered); returns the rows left for the per-row loop. Not padded
    to one length: a prompt's result is then bit for bit its own call's (each batch entry's
    blocks are those of its length), whatever else the step holds."""
    lens = (qsl[rows + 1] - qsl[rows]).astype(np.int64)
    whole = lens == seq_lens[rows]
    if window > 0:
        whole &= lens <= window
    lengths, counts = np.unique(lens[whole], return_counts=True)
    done = np.zeros(rows.size, np.bool_)
    for length in lengths[counts > 1].tolist():
        members = whole & (lens == length)
        batch = rows[members]
        first = int(qsl[batch[0]])
        if np.array_equal(qsl[batch] - first, np.arange(batch.size) * length):
            idx = slice(first, first + batch.size * length)  # side by side: views
        else:
            idx = torch.from_numpy((qsl[batch][:, None] + np.arange(length)).reshape(-1))
        qb, kb, vb = (t[idx].unflatten(0, (batch.size, length)).transpose(1, 2).to(q.dtype)
                      for t in (q, k, v))  # [B, heads, L, D]
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                           enable_gqa=True)
        out[idx] = o.transpose(1, 2).flatten(0, 1)
        done |= members
    return rows[~done]


def _window_mask(query_len: int, seq_len: int, window: int, device: torch.device,
                 key_start: int = 0) -> torch.Tensor | None:
    """[query_len, seq_len - key_start] bool: which keys from `key_start` on each of a chunk's
    queries (the last query_len positions) sees, causal and within `window`; None where plain
    causal attention is it."""
    if query_len == seq_len and (window <= 0 or window >= seq_len):
        return None
    key_pos = torch.arange(key_start, seq_len, device=device)
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window > 0:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask


def _token_by_token(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int, softcap: float,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """Batch-invariant attention: every query token, prefill or decode, as a decode row of the
    numba kernel over its sequence's keys up to its own position (one order, no context
    splits: batch_invariant.py). A token's result is then the same whether its request's
    prompt came in one chunk or many, from the prefix cache or computed, and whatever rows
    share the step."""
    qsl = meta.query_start_loc_np[:meta.num_reqs + 1]
    tokens = int(qsl[-1])
    query_lens = np.diff(qsl)
    rows = np.repeat(np.arange(meta.num_reqs), query_lens)
    # Token t of request r sits at seq_len - query_len + (t - start): it sees that many + 1.
    ends = np.asarray(meta.seq_lens_np[:meta.num_reqs], np.int64) - query_lens
    token_lens = (ends[rows] + np.arange(tokens) - qsl[:-1][rows] + 1).astype(np.int32)
    tables = meta.block_tables[torch.from_numpy(rows)]
    out = torch.zeros_like(q)
    out[:tokens] = decode_numba.decode_attention(q[:tokens], kv_cache, tables, token_lens,
                                                 scale, meta.num_layers, window, softcap, sinks)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None, softcap: float = 0.0,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (mask None) or masked attention of q [H, q, D] over k, v [KV, L, D] (GQA). Given
    with a batch dimension: torch's CPU flash kernel takes only 4-D inputs, and 3-D ones ran
    its math fallback at half the speed (bench/README.md). Soft-capped scores or sink logits:
    transformers' eager order (scale, cap, mask, the sink column, float32 softmax, rounded to
    q's dtype)."""
    if softcap > 0.0 or sinks is not None:
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        if softcap > 0.0:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is None:
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril(
                k.shape[1] - q.shape[1])
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            column = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
            scores = torch.cat([scores, column], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs[..., :k.shape[1]], v)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=True)
    return o[0]


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, window: int = 0, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    rows, num_heads, head_dim = q.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(meta.seq_lens_np[:rows].max())
    num_blocks = -(-max_len // block_size)
    block_ids = meta.block_tables[:rows, :num_blocks].long()
    k = k_cache[block_ids].view(rows, num_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[block_ids].view(rows, num_blocks * block_size, num_kv_heads, head_dim)
    qg = q.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k.to(q.dtype)) * scale
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(num_blocks * block_size, device=q.device)
    past_end = key_pos[None, :] >= meta.seq_lens[:rows, None]
    hidden = past_end
    if window > 0:  # and the keys before the window
        hidden = past_end | (key_pos[None, :] < meta.seq_lens[:rows, None] - window)
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    # A block's slots past seq_len may hold a finished request's values, NaN if its logits
    # were (it ended with an error), and so may a windowed row's blocks given back before its
    # window: a zero probability times NaN would still be NaN.
    v.masked_fill_(hidden[:, :, None, None], 0.0)
    if sinks is not None:  # one more logit per head, with no value
        sink = sinks.to(scores.dtype).view(1, num_kv_heads, -1, 1).expand(rows, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgs,bskd->bkgd", probs, v.to(q.dtype)).reshape(rows, num_heads,
                                                                        head_dim)
