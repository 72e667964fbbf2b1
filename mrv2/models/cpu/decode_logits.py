"""The LM head inside the fused decode stack (decode.py): a decode step's logits computed by
the stack's one numba call, right after the final norm, instead of by a second call that
streams the head's weight after the Python between them.

Why: at batch 1 a small model's step is a few milliseconds, and each separate call pays its
Python, its argument unboxing and, after a weight stream has evicted the interpreter's working
set from the caches, that set's refetch (bench/README.md). The stack multiplies its output rows
by the head's weight with the kernel the model's `compute_logits` would run on them (the GEMV
of quantized.py's `quantized_linear` or cpu_linear's float32 one; `LmHead.max_rows` bounds the
rows where that holds) and returns the logits with the hidden states; the runner samples from
them instead of calling `compute_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrv2.models.layers.cpu_gemv import MAX_GEMV_ROWS
from mrv2.models.layers.quantized import PackedWeight


def float32_cpu(weight: torch.Tensor) -> bool:
    """A contiguous float32 CPU tensor: what the stack reads as a float32 view."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.is_contiguous()


@dataclass(frozen=True)
class LmHead:
    """The weight the model's `compute_logits` multiplies by, which the stack multiplies its
    output rows by too, and the most rows `compute_logits` runs on the GEMV kernel the stack
    calls (`max_rows`): beyond, it takes another kernel, whose rounding may differ, so the
    stack computes no logits there."""

    weight: PackedWeight | torch.Tensor
    max_rows: int


def lm_head(model) -> LmHead | None:
    """The LM head of `model` (a causal LM with a `decoder_spec`: its `compute_logits` is
    `vocab_embedding.parallel_logits` of `lm_head` or the tied embedding) as the stack
    computes it: the GGUF blocks or 16-bit weight it is packed as, or its float32 CPU weight
    on one rank; None when its logits are computed any other way."""
    head = getattr(model, "lm_head", None)
    if head is None:  # tied: the embedding's table
        head = model.model.embed_tokens
    if head.tp_size != 1:
        return None
    if head.packed is not None:
        return LmHead(head.packed, head.packed.plan.numba_rows)
    if float32_cpu(head.weight):
        return LmHead(head.weight, MAX_GEMV_ROWS)
    return None
