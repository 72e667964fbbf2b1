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
already work row by row; the sampling filters' masses (top-k / top-p) still reduce in torch.

The mode is process-wide: a worker sets it from its ModelConfig before it loads the model
(weights' plans are made at load) and kernels read it when they run, so engines of both modes
must not share a process. CPU only: the CUDA path refuses it (EngineArgs).
"""

from __future__ import annotations

_enabled = False


def active() -> bool:
    return _enabled


def set_active(on: bool) -> None:
    """The worker, before loading the model: the kernels' choices follow from here on."""
    global _enabled
    _enabled = bool(on)
