"""The LM head inside the fused decode stack (decode.py): a decode step's logits computed by
the stack's one numba call, right after the final norm, instead of by a second call that
streams the head's weight after the Python between them.

Why: at batch 1 a small model's step is a few milliseconds, and each separate call pays its
Python, its argument unboxing and, after a weight stream has evicted the interpreter's working
set from the caches, that set's refetch (bench/README.md). The stack multiplies its output rows
by the head's weight with the kernel `compute_logits` would run on them (the GEMV of
quantized.py's `quantized_linear` or cpu_linear's float32 one, `LmHead.max_rows` bounds the
rows where that holds), keeps the logits with the hidden states it returned, and the model's
`compute_logits` (a `StackLogits`) hands them out when asked for exactly those hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mrv2.models.cpu.decode import FusedDecode, _float32
from mrv2.models.cpu.quantized_weights import QuantizedLogits
from mrv2.models.layers import quantized
from mrv2.models.layers.cpu_gemv import MAX_GEMV_ROWS
from mrv2.models.layers.quantized import QuantizedWeight
from mrv2.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class LmHead:
    """The weight the model's `compute_logits` multiplies by, which the stack multiplies its
    output rows by too, and the most rows `compute_logits` runs on the GEMV kernel the stack
    calls (`max_rows`): beyond, it takes another kernel, whose rounding may differ, so the
    stack computes no logits there."""

    weight: QuantizedWeight | torch.Tensor
    max_rows: int


def lm_head(model) -> LmHead | None:
    """The LM head of `model` (a LlamaForCausalLM) as the stack computes it: the GGUF blocks
    or 16-bit weight its `QuantizedLogits` multiplies by, or the float32 CPU weight of its
    own `compute_logits` on one rank; None when its logits are computed any other way."""
    logits = model.__dict__.get("compute_logits")
    if isinstance(logits, QuantizedLogits):
        return LmHead(logits.weight, quantized.max_numba_rows(logits.weight))
    if logits is not None or type(model).compute_logits is not LlamaForCausalLM.compute_logits:
        return None
    head = getattr(model, "lm_head", None)
    if head is None:  # tied: the embedding's table
        head = model.model.embed_tokens
    if head.tp_size == 1 and _float32(head.weight):
        return LmHead(head.weight, MAX_GEMV_ROWS)
    return None


class StackLogits:
    """`compute_logits` of a model whose decode steps run the fused stack with the LM head in
    it: a stack step's logits for the hidden states that step returned, `compute_logits`
    itself for any other rows. Invariant: nobody writes into a step's hidden states before
    their logits are taken (the runner passes a decode step's hidden states on whole, as
    they came); the stack's logits are the same kernel's on the same rows (`LmHead`)."""

    def __init__(self, fused: FusedDecode,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fused = fused
        self.compute_logits = compute_logits

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.fused.take_logits(hidden_states)
        return self.compute_logits(hidden_states) if logits is None else logits


def attach_stack_logits(model, fused: FusedDecode) -> bool:
    """Put the LM head of `model` (the LlamaForCausalLM around `fused`'s LlamaModel, its
    `compute_logits` as loaded and attached) into the fused stack, when `lm_head` has it:
    the stack's steps compute their rows' logits, and `model.compute_logits` becomes a
    `StackLogits` that hands them out. Returns whether it did."""
    head = lm_head(model)
    if head is None:
        return False
    fused.head, fused.args = head, None
    model.compute_logits = StackLogits(fused, model.compute_logits)
    return True
