"""Triton kernel for the penalties stage, with allowed_token_ids fused in (penalties.py and
bias.py hold the torch versions, which are the reference; logit bias and min_tokens are in
bias_triton.py).

``apply_allowed_and_penalties_``: allowed_token_ids and the three penalties; one program per
(row, vocab block), reading the slot's bitmask words and output counts. A row with neither feature loads
its parameters and stores nothing.

It reads every parameter through ``idx_mapping`` and modifies the float32 logits in place.
Float operations are the torch versions', in the same order: under the interpreter the
results are bit-for-bit equal; compiled for a GPU, ``x - freq * count`` may fuse into an FMA
(within float tolerance). The division by the repetition penalty is ``div_rn`` (IEEE
round-to-nearest, like torch), not Triton's default approximate division.

Kernels use only ``tl`` builtins (see mrv2/platform.py).
"""

from __future__ import annotations

import triton.language as tl
from torch import Tensor

from mrv2.platform import triton_kernel


def _dense_kernel(x_ptr, x_stride, idx_mapping_ptr, vocab_size,
                  has_allowed_ptr, allowed_ptr, allowed_stride,
                  rep_ptr, pres_ptr, freq_ptr, counts_ptr, counts_stride,
                  prompt_ptr, prompt_stride,
                  APPLY_ALLOWED: tl.constexpr, APPLY_PENALTIES: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    word = offs >> 5
    bit = offs & 31
    use_allowed = False
    use_penalties = False
    if APPLY_ALLOWED:
        use_allowed = tl.load(has_allowed_ptr + slot) != 0
    if APPLY_PENALTIES:
        rep = tl.load(rep_ptr + slot)
        pres = tl.load(pres_ptr + slot)
        freq = tl.load(freq_ptr + slot)
        use_penalties = (rep != 1.0) | (pres != 0.0) | (freq != 0.0)
    if use_allowed | use_penalties:
        x_row = x_ptr + row * x_stride
        x = tl.load(x_row + offs, mask=mask, other=0.0)
        if APPLY_ALLOWED:
            if use_allowed:
                words = tl.load(allowed_ptr + slot * allowed_stride + word, mask=mask, other=0)
                x = tl.where(((words >> bit) & 1) != 0, x, float("-inf"))
        if APPLY_PENALTIES:
            if use_penalties:
                counts = tl.load(counts_ptr + slot * counts_stride + offs, mask=mask, other=0)
                words = tl.load(prompt_ptr + slot * prompt_stride + word, mask=mask, other=0)
                seen = (((words >> bit) & 1) != 0) | (counts > 0)
                penalised = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
                x = tl.where(seen, penalised, x)
                x = x - freq * counts.to(tl.float32)
                x = x - pres * (counts > 0).to(tl.float32)
        tl.store(x_row + offs, x, mask=mask)


def apply_allowed_and_penalties_(x: Tensor, idx_mapping: Tensor, states, *, apply_allowed: bool,
                 apply_penalties: bool, block: int = 1024) -> None:
    """allowed_token_ids and/or the penalties on float32 ``x`` [B, V], in place."""
    num_rows, vocab_size = x.shape
    if num_rows == 0 or not (apply_allowed or apply_penalties):
        return
    allowed = states.bias.allowed.words if apply_allowed else None
    counts = states.penalties.output_counts if apply_penalties else None
    prompt = states.penalties.prompt_mask.words if apply_penalties else None
    dummy = states.min_tokens.tensor.view(1, -1)
    allowed = dummy if allowed is None else allowed
    counts = dummy if counts is None else counts
    prompt = dummy if prompt is None else prompt
    grid = (num_rows, (vocab_size + block - 1) // block)
    triton_kernel(_dense_kernel)[grid](
        x, x.stride(0), idx_mapping, vocab_size,
        states.bias.has_allowed.tensor, allowed, allowed.stride(0),
        states.repetition_penalty.tensor, states.presence_penalty.tensor,
        states.frequency_penalty.tensor, counts, counts.stride(0), prompt, prompt.stride(0),
        APPLY_ALLOWED=apply_allowed, APPLY_PENALTIES=apply_penalties, BLOCK=block)
