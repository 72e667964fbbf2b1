"""Attention layer interface and the per-step metadata every backend reads.

A step is one flattened batch of tokens: rows (requests) are contiguous runs of tokens,
decode rows (query length 1) first, then prefill chunks. Each layer's KV cache is one tensor
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V); a token's K/V is written to
flat slot `slot_mapping[t]` = block_id * block_size + offset, and -1 means "do not write"
(graph padding).

Which backend runs (DESIGN.md section 5) is decided by `mrv2.platform.kernel_impl`, like
every other kernel: CUDA tensors use the Triton paged attention (`paged_triton`, CUDA-graph
capturable: it reads only the metadata's device tensors), CPU tensors the torch one
(`paged_torch`, which reads the host copies). Tests force a backend with
`mrv2.platform.forced_impl()` (the torch backend runs on any device, so the override holds on
CUDA tensors too); the Triton one runs on CPU tensors only under
`mrv2.platform.triton_interpreter()`.

Decode-only steps on the Triton backend run the split-KV kernels (`split_kv_triton`: each
row's context split over many programs, so batch 1 fills the GPU) once the layer holds split-KV
scratch: `attach_split_kv_scratch(model, ...)`, called once before CUDA-graph capture, gives
every layer one shared set of buffers sized for max_num_seqs rows. Without it, or for a padded
row count the scratch does not hold, they run `paged_triton` as mixed steps do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mrv2 import batch_invariant, platform


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
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    max_seq_len: int
    # How many layers read K/V under this metadata (the model's): sizes a decode step's cache
    # reads for the CPU kernel's work split (decode_numba.work_split).
    num_layers: int = 1
    # The requests of the decode rows: several verify rows of one request (speculative
    # decoding) count once. The CPU decode attention's work split follows it rather than the
    # rows, so a verify row's attention is summed as its request's one decode row would be.
    # None: num_decodes.
    num_decode_sequences: int | None = None
    # A hybrid KV layout (core/kv_cache_layout.py): the same step's metadata for KV cache
    # groups 1, 2, ... (their own block tables and slot mappings); block_tables and
    # slot_mapping above are group 0's. Empty for a model with one group.
    other_groups: tuple[AttentionMetadata, ...] = ()
    # Each row's persistent slot [num_reqs] (int64, and its host copy): where a recurrent
    # layer keeps the row's state (models/layers/gated_delta_rule.py). None: not given.
    slots: torch.Tensor | None = None
    slots_np: np.ndarray | None = None

    @functools.cached_property
    def rows_with_context(self) -> torch.Tensor:
        """[num_reqs] bool: the rows whose request computed tokens before this step (a
        recurrent layer continues their stored state). Computed once a step, not per layer."""
        starts = self.query_start_loc[:self.num_reqs + 1]
        return (self.seq_lens[:self.num_reqs] - (starts[1:] - starts[:-1])) > 0

    @property
    def decode_sequences(self) -> int:
        """The requests of the decode rows (`num_decode_sequences`, else one per row)."""
        return self.num_decodes if self.num_decode_sequences is None else (
            self.num_decode_sequences)

    def for_group(self, group: int) -> AttentionMetadata:
        """This step's metadata for KV cache group `group`."""
        return self if group == 0 else self.other_groups[group - 1]


def attention_backend(device: torch.device) -> str:
    """platform.TRITON for CUDA tensors, platform.CPU (the torch twin, paged_torch.py) for any
    other, unless `platform.forced_impl()` says."""
    return platform.kernel_impl(device, portable_cpu_impl=True)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class Attention(nn.Module):
    """Causal self-attention over the paged KV cache of one layer; with `sliding_window` > 0 a
    query at position p sees the keys p - sliding_window + 1 .. p only (transformers' and
    llama.cpp's window: `p - k < sliding_window`); with `softcap` > 0 the scaled scores are
    soft-capped to softcap * tanh(s / softcap) before the softmax (Gemma 2). `sinks`: this
    rank's heads' sink logits [num_heads] (gpt-oss), one more logit in each head's softmax with
    no value; a parameter its model loads (None: none). `kv_cache_group`: the group whose
    block tables its cache follows (core/kv_cache_layout.py)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int = 0, softcap: float = 0.0, sinks: bool = False,
                 kv_cache_group: int = 0) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        if sliding_window < 0:
            raise ValueError(f"sliding_window={sliding_window} must be positive (0: none)")
        self.sliding_window = sliding_window
        self.softcap = float(softcap)
        # Which KV cache group's block tables this layer reads (core/kv_cache_layout.py).
        self.kv_cache_group = kv_cache_group
        self.sinks = (nn.Parameter(torch.empty(num_heads, dtype=torch.float32),
                                   requires_grad=False) if sinks else None)
        # Set by attach_split_kv_scratch; shared with every layer of the same head shape.
        self.split_kv_scratch = None

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KV*D] -> [T, H*D]. Writes k/v into the cache first; k and v
        None: the cache already holds this step's keys and values (a KV-shared layer reads
        what its source layer wrote earlier in the step).

        Only the first `meta.num_actual_tokens` tokens are used and returned. On the Triton
        backend, tokens among them that belong to no row (graph padding past
        `query_start_loc[-1]`) come back uninitialised.
        """
        meta = meta.for_group(self.kv_cache_group)
        n = meta.num_actual_tokens
        q = q[:n].view(n, self.num_heads, self.head_dim)
        writes = k is not None
        if writes:
            k = k[:n].view(n, self.num_kv_heads, self.head_dim)
            v = v[:n].view(n, self.num_kv_heads, self.head_dim)
        if attention_backend(q.device) == platform.TRITON:
            from mrv2.attention import paged_triton

            if writes:
                paged_triton.write_kv(k, v, kv_cache, meta.slot_mapping[:n])
            # Batch-invariant mode: one kernel and one query tile size for every step, so a
            # token's sums do not depend on what else the step holds.
            uniform_decode = (meta.num_decodes == meta.num_reqs
                              and not batch_invariant.active())
            scratch = self.split_kv_scratch
            num_rows = meta.query_start_loc.shape[0] - 1
            if (uniform_decode and scratch is not None
                    and scratch.fits(num_rows, self.num_heads, self.head_dim)):
                from mrv2.attention import split_kv_triton

                out = split_kv_triton.split_kv_decode(
                    q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                    self.scale, scratch, window=self.sliding_window, softcap=self.softcap,
                    sinks=self.sinks)
            else:
                out = paged_triton.paged_attention(
                    q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                    self.scale, uniform_decode=uniform_decode, window=self.sliding_window,
                    softcap=self.softcap, sinks=self.sinks)
        else:
            from mrv2.attention import paged_torch

            if writes:
                paged_torch.write_kv(k, v, kv_cache, meta.slot_mapping[:n])
            out = paged_torch.paged_attention(q, kv_cache, meta, self.scale, k, v,
                                              window=self.sliding_window, softcap=self.softcap,
                                              sinks=self.sinks)
        return out.reshape(n, self.num_heads * self.head_dim)


def attach_split_kv_scratch(model: nn.Module, max_num_seqs: int, max_model_len: int,
                            device: torch.device, num_splits: int | None = None) -> None:
    """Give every `Attention` layer of `model` split-KV decode scratch for up to
    `max_num_seqs` rows (the padded row count of any decode step), one set per head shape,
    shared by the layers. The split count comes from the device and `max_model_len`
    (`split_kv_triton.num_kv_splits`) unless given. Call once, before CUDA-graph capture."""
    from mrv2.attention import split_kv_triton

    shared: dict[tuple[int, int, int], object] = {}
    for layer in model.modules():
        if not isinstance(layer, Attention):
            continue
        key = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
        if key not in shared:
            splits = num_splits or split_kv_triton.num_kv_splits(
                layer.num_kv_heads, max_model_len, device)
            shared[key] = split_kv_triton.SplitKVScratch.allocate(
                max_num_seqs, layer.num_heads, splits, layer.head_dim, device)
        layer.split_kv_scratch = shared[key]
