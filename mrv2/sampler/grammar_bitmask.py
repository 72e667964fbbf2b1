"""The structured-output (grammar) stage: a token bitmask per constrained row, in xgrammar's
layout, applied to the logits before sampling.

``apply_grammar_bitmask_(logits, rows, bitmask)``: row ``i`` of ``bitmask`` belongs to batch row
``rows[i]``; token ``t`` is allowed there iff bit ``t % 32`` (least-significant first) of word
``bitmask[i, t // 32]`` is 1 (the int32 is a bit pattern: word -1 allows all 32). Every
disallowed token ``t < V`` of those rows gets ``-inf``, in place; other rows are untouched.

``platform.kernel_impl`` picks the implementation: CPU tensors run the torch version here,
others the Triton twin (grammar_bitmask_triton.py), as do CPU tensors under the interpreter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mrv2 import platform

_BYTE_SHIFTS: dict[torch.device, Tensor] = {}


def _check_grammar_args(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits must be a contiguous float32 [B, V] tensor, got "
                         f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"rows must be an int64 [R] tensor, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    words = (logits.shape[1] + 31) // 32
    if bitmask.dtype != torch.int32 or tuple(bitmask.shape) != (rows.shape[0], words):
        raise ValueError(f"bitmask must be int32 [R, ceil(V / 32)] = [{rows.shape[0]}, {words}], "
                         f"got {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.device != logits.device or bitmask.device != logits.device:
        raise ValueError(f"logits, rows and bitmask must share one device, got {logits.device}, "
                         f"{rows.device}, {bitmask.device}")


def _disallowed(bitmask: Tensor, vocab_size: int) -> Tensor:
    """``[R, W]`` int32 words -> ``[R, vocab_size]`` bool, True where the bit is 0: one byte per
    token, the only allocation. The words are read as bytes (little-endian: byte k holds bits
    8k..8k+7), each byte shifted by 0..7."""
    shifts = _BYTE_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BYTE_SHIFTS[bitmask.device] = torch.arange(8, dtype=torch.uint8,
                                                             device=bitmask.device)
    bits = bitmask.view(torch.uint8).unsqueeze(-1) >> shifts  # [R, 4W, 8]
    bits.bitwise_and_(1).bitwise_xor_(1)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].view(torch.bool)


def apply_grammar_bitmask_(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    """``logits[rows[i], t] = -inf`` for every token ``t`` whose bit in ``bitmask[i]`` is 0.

    Args:
        logits: [B, V] float32, contiguous; modified in place.
        rows: [R] int64 on the logits' device: distinct batch rows in ``[0, B)`` (not checked:
            checking would read the device).
        bitmask: [R, ceil(V / 32)] int32 on the logits' device, xgrammar's layout.
    """
    _check_grammar_args(logits, rows, bitmask)
    if rows.shape[0] == 0:
        return
    rows, bitmask = rows.contiguous(), bitmask.contiguous()  # no copy when they are already
    if platform.kernel_impl(logits.device) == platform.TRITON:
        from mrv2.sampler import grammar_bitmask_triton  # Triton is imported on first use only

        grammar_bitmask_triton.apply_grammar_bitmask_(logits, rows, bitmask)
        return
    picked = logits.index_select(0, rows)
    picked.masked_fill_(_disallowed(bitmask, logits.shape[1]), float("-inf"))
    logits.index_copy_(0, rows, picked)
