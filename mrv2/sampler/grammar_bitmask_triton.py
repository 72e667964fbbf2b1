"""Triton kernel for the grammar bitmask stage (grammar_bitmask.py holds the torch version, the
reference, and the checks of the arguments).

``apply_grammar_bitmask_``: one program per (constrained row, block of tokens). It reads the
block's bitmask words (token ``t`` at bit ``t & 31`` of word ``t >> 5``) and stores ``-inf`` at
the disallowed tokens of batch row ``rows[i]``; allowed tokens are neither loaded nor stored.

The number of constrained rows is the grid's first dimension, not an argument: the kernel's
integers (strides, vocabulary size) are fixed by the configuration, so one compiled variant
serves every batch.

Kernels use only ``tl`` builtins (see mrv2/platform.py).
"""

from __future__ import annotations

import triton.language as tl
from torch import Tensor

from mrv2.platform import triton_kernel


def _grammar_bitmask_kernel(logits_ptr, logits_stride, rows_ptr, bitmask_ptr, bitmask_stride,
                            vocab_size, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab_size
    words = tl.load(bitmask_ptr + i * bitmask_stride + (offs >> 5), mask=in_vocab, other=-1)
    disallowed = in_vocab & (((words >> (offs & 31)) & 1) == 0)
    row = tl.load(rows_ptr + i)
    tl.store(logits_ptr + row * logits_stride + offs,
             tl.full([BLOCK], float("-inf"), tl.float32), mask=disallowed)


def apply_grammar_bitmask_(logits: Tensor, rows: Tensor, bitmask: Tensor, *,
                           block: int = 4096) -> None:
    """The grammar stage on float32 ``logits`` [B, V], in place (arguments as checked by
    grammar_bitmask.apply_grammar_bitmask_)."""
    num_rows = rows.shape[0]
    vocab_size = logits.shape[1]
    if num_rows == 0:
        return
    grid = (num_rows, (vocab_size + block - 1) // block)
    triton_kernel(_grammar_bitmask_kernel)[grid](
        logits, logits.stride(0), rows, bitmask, bitmask.stride(0), vocab_size, BLOCK=block)
