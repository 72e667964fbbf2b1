"""Vocabulary-parallel embedding and LM head.

Each rank holds ceil(V/tp) vocabulary rows (zero-padded at the end). Embedding lookups outside
the rank's range are masked to zero and summed with all_reduce; the LM head's logits are
all-gathered, so every rank ends with the same full [N, V] logits and samples the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2 import batch_invariant, distributed
from mrv2.models.layers import cpu_linear
from mrv2.models.layers.linear import (ShardId, _copy, check_unfused, narrow,
                                       set_weight_attrs, tensor_shape, tp_rank_and_size)
from mrv2.models.layers.quantized import PackedWeight, quantized_linear


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """(start, rows, padded_rows): rank `tp_rank` holds vocabulary rows [start, start + rows)
    in a parameter of `padded_rows` = ceil(V / tp) rows (the rest zero)."""
    padded = -(-vocab_size // tp_size)
    start = min(tp_rank * padded, vocab_size)
    return start, min(padded, vocab_size - start), padded


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over the ranks: a rank looks up the ids in its
    range, zeroes the others, and all_reduce sums the ranks' rows (exactly one is non-zero).

    `packed` (one rank only): the GGUF blocks or 16-bit weight the loader gave it in place of
    `weight` (linear.set_packed); lookups dequantize or widen its rows exactly, and logits
    multiply by it."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_rank: int | None = None,
                 tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.num_embeddings, self.embedding_dim = vocab_size, hidden_size
        self.vocab_start, self.vocab_rows, padded = vocab_range(vocab_size, self.tp_rank,
                                                                self.tp_size)
        self.num_embeddings_per_partition = padded
        self.weight = nn.Parameter(torch.empty(padded, hidden_size), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader, shard_ids=(None,))
        self.packed: PackedWeight | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: ShardId = None) -> None:
        check_unfused(param, shard_id)
        full = (self.num_embeddings, param.shape[1])
        if tensor_shape(loaded) != full:
            raise ValueError(f"weight: checkpoint tensor has shape {tensor_shape(loaded)}, "
                             f"expected {full}")
        rows = self.vocab_rows
        with torch.no_grad():
            param[rows:].zero_()
        if rows:
            _copy(param.narrow(0, 0, rows), narrow(loaded, 0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.dequantize_rows(input_ids.reshape(-1)).reshape(
                *input_ids.shape, self.packed.in_features)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return distributed.tp_all_reduce(out)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (rows {self.vocab_start}.."
                f"{self.vocab_start + self.vocab_rows} on rank {self.tp_rank}/{self.tp_size}), "
                f"dim={self.embedding_dim}")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection with the vocabulary split like `VocabParallelEmbedding`:
    `logits` computes this rank's [N, V/tp] and all-gathers them into the full [N, V], the same
    on every rank."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise RuntimeError("ParallelLMHead is not an embedding; call logits(hidden_states)")

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return parallel_logits(hidden_states, self)


def parallel_logits(hidden_states: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor:
    """hidden [N, hidden] -> float32 logits [N, V] through a vocab-split weight (an LM head or
    the tied embedding)."""
    if head.packed is not None:
        return quantized_linear(hidden_states.float(), head.packed, float32_sums=True)
    logits = float32_logits(hidden_states, head.weight)
    if head.tp_size > 1:
        logits = distributed.tp_all_gather(logits, dim=-1)[:, :head.num_embeddings]
    return logits


def float32_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] @ weight [V, H]^T -> float32 [N, V], never rounded to a 16-bit dtype: a
    bfloat16 grid (0.125 apart between 16 and 32) ties tokens whose float32 logits differ.
    A 16-bit model's products are summed into float32 outputs (torch.mm's `out_dtype` on
    CUDA); where no such kernel is at hand, both operands are widened to float32."""
    if batch_invariant.triton_matmuls(hidden_states.device):
        from mrv2.models.layers import matmul_triton

        return matmul_triton.invariant_linear(hidden_states, weight.to(hidden_states.dtype),
                                    out_dtype=torch.float32)
    if hidden_states.dtype == weight.dtype == torch.float32:
        return cpu_linear.linear(hidden_states, weight)
    if hidden_states.is_cuda and hidden_states.dtype == weight.dtype and _MM_OUT_DTYPE:
        return torch.mm(hidden_states, weight.T, out_dtype=torch.float32)
    return F.linear(hidden_states.float(), weight.float())


# torch.mm(..., out_dtype=) (CUDA's 16-bit products into float32 outputs; torch 2.8 and later).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")
