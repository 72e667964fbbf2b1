"""Attention layer interface and the per-step metadata every backend reads.

A step is one flattened batch of tokens: rows (requests) are contiguous runs of tokens,
decode rows (query length 1) first, then prefill chunks. Each layer's KV cache is one tensor
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V); a token's K/V is written to
flat slot `slot_mapping[t]` = block_id * block_size + offset, and -1 means "do not write"
(graph padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    # Rows [0, num_decodes) have exactly one query token each.
    num_decodes: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: cached prefix + this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, batch order
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = skip
    # Host copies for shapes: the step loop never reads a device tensor back.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    max_seq_len: int


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class Attention(nn.Module):
    """Causal self-attention over the paged KV cache of one layer."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KV*D] -> [T, H*D]. Writes k/v into the cache first."""
        from mrv2.attention import torch_paged

        n = meta.num_actual_tokens
        q = q[:n].view(n, self.num_heads, self.head_dim)
        k = k[:n].view(n, self.num_kv_heads, self.head_dim)
        v = v[:n].view(n, self.num_kv_heads, self.head_dim)
        torch_paged.write_kv(k, v, kv_cache, meta.slot_mapping[:n])
        out = torch_paged.paged_attention(q, kv_cache, meta, self.scale)
        return out.view(n, self.num_heads * self.head_dim)
