"""Triton kernel for the logit bias and min_tokens stages (bias.py holds the torch versions,
which are the reference; the allowed_token_ids stage is fused into penalties_triton.py's dense
kernel).

``apply_bias_and_min_tokens_``: logit bias and min_tokens stop ids; one program per batch row,
reading the row's per-slot lists (a few ids each, at most 1024). It reads every parameter through
``idx_mapping`` and modifies the float32 logits in place. Float operations are the torch
versions', in the same order: under the interpreter the results are bit-for-bit equal.

Kernels use only ``tl`` builtins (see mrv2/platform.py).
"""

from __future__ import annotations

import triton.language as tl
from torch import Tensor

from mrv2.platform import triton_kernel


def _sparse_kernel(x_ptr, x_stride, idx_mapping_ptr, pos_ptr,
                   bias_len_ptr, bias_ids_ptr, bias_vals_ptr, bias_width,
                   stop_len_ptr, stop_ids_ptr, stop_width, min_tokens_ptr, prompt_len_ptr,
                   APPLY_BIAS: tl.constexpr, APPLY_STOP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    x_row = x_ptr + row * x_stride
    if APPLY_BIAS:
        n = tl.load(bias_len_ptr + slot)
        for start in range(0, bias_width, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            ids = tl.load(bias_ids_ptr + slot * bias_width + offs, mask=mask, other=0)
            vals = tl.load(bias_vals_ptr + slot * bias_width + offs, mask=mask, other=0.0)
            cur = tl.load(x_row + ids, mask=mask, other=0.0)
            tl.store(x_row + ids, cur + vals, mask=mask)
    if APPLY_STOP:
        num_output = tl.load(pos_ptr + row) - tl.load(prompt_len_ptr + slot)
        if num_output < tl.load(min_tokens_ptr + slot):
            n = tl.load(stop_len_ptr + slot)
            for start in range(0, stop_width, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                ids = tl.load(stop_ids_ptr + slot * stop_width + offs, mask=mask, other=0)
                tl.store(x_row + ids, tl.full([BLOCK], float("-inf"), tl.float32), mask=mask)


def apply_bias_and_min_tokens_(x: Tensor, idx_mapping: Tensor, positions: Tensor, states, *,
                  apply_bias: bool, apply_stop: bool, block: int = 128) -> None:
    """Logit bias and/or min_tokens stop ids on float32 ``x`` [B, V], in place."""
    num_rows = x.shape[0]
    if num_rows == 0 or not (apply_bias or apply_stop):
        return
    bias, stop = states.bias.bias, states.bias.stop_ids
    dummy_i = states.min_tokens.tensor  # any int32 tensor: never read when its stage is off
    dummy_f = states.temperature.tensor
    triton_kernel(_sparse_kernel)[(num_rows,)](
        x, x.stride(0), idx_mapping, positions,
        bias.lengths.tensor, bias.ids if apply_bias else dummy_i,
        bias.values if apply_bias else dummy_f, bias.width if apply_bias else 0,
        stop.lengths.tensor, stop.ids if apply_stop else dummy_i,
        stop.width if apply_stop else 0, states.min_tokens.tensor,
        states.requests.prompt_len.tensor,
        APPLY_BIAS=apply_bias, APPLY_STOP=apply_stop, BLOCK=block)
