"""Batch-invariant mode: a request's tokens and logprobs are the same bits whatever else is in
its batch, wherever it sits in the batch, whether its prefix came from the prefix cache or was
computed, however its prompt was chunked, and at any thread count (vLLM's
VLLM_BATCH_INVARIANT; `LLM(..., batch_invariant=True)`, `mrv2 serve --batch-invariant`,
MRV2_BATCH_INVARIANT=1).

How: every reduction takes one fixed order that depends on neither the number of rows nor the
number of threads. The kernels that would choose by row count choose once: a packed weight's
plan keeps its few-row kernel (a GEMV, each row's dot in a fixed order) for every row count
(linear_plan.plan_for), a float32 linear always runs the numba GEMV (cpu_linear.linear),
attention runs every query token, prefill included, through the decode kernel with no context
splits (paged_torch.paged_attention, decode_numba.work_split), the oneDNN paths (matrix
units, thread-dependent blockings) are off, and logprobs take each row's logsumexp in one order
(sampler/logprobs_numba.py). Norms, rotary, activations, the embedding and greedy sampling
already work row by row, and so do the sampling filters (per-row sorts, softmax and
cumulative sums: tests/test_batch_invariant.py samples the demo's chats through them).

On CUDA (the Triton kernels): the linears and the LM head run matmul_triton.py (one tile shape
for every row count, no split-K) instead of cuBLAS, and attention runs paged_triton with one
query tile size for decode and prefill and no split-KV (attention/backend.py). Norms, rotary,
activations, logprobs and the sampler's kernels already give each row one program.

The mode is process-wide: a worker sets it from its ModelConfig before it loads the model
(weights' plans are made at load) and kernels read it when they run, so engines of both modes
must not share a process.
"""

from __future__ import annotations

import torch

from mrv2 import platform

_enabled = False


def active() -> bool:
    return _enabled


def set_active(on: bool) -> None:
    """The worker, before loading the model: the kernels' choices follow from here on."""
    global _enabled
    _enabled = bool(on)


def triton_matmuls(device: torch.device) -> bool:
    """Whether a linear on `device` runs matmul_triton.py: in this mode, on the Triton
    kernels' device."""
    return _enabled and platform.kernel_impl(device) == platform.TRITON
