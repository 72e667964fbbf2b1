"""What the Triton layer twins' tests share: tolerances per dtype, and how many variants of a
kernel Triton compiled (a per-step integer must not add one)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from mrv2 import platform

# Compiled-kernel tests: marked `cuda`, and skipped where no GPU is visible.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The interpreter rounds float32 -> bfloat16 toward zero where the GPU (and torch) round to
# nearest, so interpreted bf16 results may differ from torch by one bf16 ulp per rounding.
INTERPRETED_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5),
                   torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
# Compiled: float32 differs by the sum order and rsqrt's last bits; bf16 by one rounding that
# an ulp of float32 tipped.
COMPILED_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5),
                torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def compiled_variants(fn: Callable, do_not_specialize: tuple[str, ...] = ()) -> int:
    """How many binaries Triton holds for kernel `fn` (compiled mode, jitted with
    `do_not_specialize` as its owner does) on the current GPU."""
    kernel = platform.triton_kernel(fn, do_not_specialize)
    return len(kernel.device_caches[torch.cuda.current_device()][0])
