"""Which implementation runs the state and input kernels: Triton or CPU (DESIGN.md section 5).

Tensors on CUDA use the Triton kernels; CPU tensors use the numba kernels. Triton is imported
only when a Triton kernel is first needed, so a CPU-only machine without a working Triton
never touches it.

Tests force the Triton path on CPU tensors with `triton_interpreter()`: inside it every
kernel launch uses Triton's interpreter. Kernels are kept as plain functions and jitted on
first use, once per mode (compiled or interpreted), so both kinds coexist in one process.
Kernels use only `tl` builtins (`tl.full`, not `tl.zeros` or `tl.cdiv`): Triton's own jitted
helpers run under the interpreter only when triton was first imported with TRITON_INTERPRET=1,
which a process that also runs compiled kernels cannot promise.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Iterator

import torch

TRITON = "triton"
CPU = "cpu"

_forced_impl: str | None = None
_interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
_jitted: dict[tuple[Callable, bool], Callable] = {}


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install raises more than ImportError
        return False
    return True


def kernel_impl(device: torch.device) -> str:
    """TRITON for CUDA tensors; CPU for CPU tensors unless a test forces TRITON."""
    if device.type == "cuda":
        if not triton_available():
            raise RuntimeError("CUDA tensors need Triton for the state and input kernels, and "
                               "`import triton` failed")
        return TRITON
    if device.type != "cpu":
        raise RuntimeError(f"no state/input kernels for device {device}")
    return _forced_impl or CPU


def triton_kernel(fn: Callable) -> Callable:
    """`triton.jit(fn)`, made once per mode: interpreted inside `triton_interpreter()`."""
    key = (fn, _interpreting)
    kernel = _jitted.get(key)
    if kernel is None:
        import triton

        kernel = _jitted[key] = triton.jit(fn)
    return kernel


@contextmanager
def forced_impl(impl: str | None) -> Iterator[None]:
    """Use `impl` for the kernels on CPU tensors inside the block (tests). CUDA tensors always
    use Triton."""
    global _forced_impl
    if impl not in (None, TRITON, CPU):
        raise ValueError(f"impl must be {TRITON!r}, {CPU!r} or None, got {impl!r}")
    previous, _forced_impl = _forced_impl, impl
    try:
        yield
    finally:
        _forced_impl = previous


@contextmanager
def triton_interpreter() -> Iterator[None]:
    """Run the Triton kernels under TRITON_INTERPRET=1 (so on CPU tensors) inside the block.

    Triton reads TRITON_INTERPRET when a function is jitted; kernels jitted here are cached
    apart from the compiled ones.
    """
    global _interpreting
    previous_env = os.environ.get("TRITON_INTERPRET")
    previous = _interpreting
    os.environ["TRITON_INTERPRET"] = "1"
    _interpreting = True
    try:
        with forced_impl(TRITON):
            yield
    finally:
        _interpreting = previous
        if previous_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous_env


def kernels_on_cpu(impl: str):
    """Context: CPU tensors use the `impl` kernels, "cpu" (numba) or "triton" (interpreted)."""
    return triton_interpreter() if impl == TRITON else forced_impl(impl)
