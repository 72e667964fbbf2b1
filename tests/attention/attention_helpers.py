"""Attention backend overrides for tests: attention's names for `mrv2.platform.forced_impl()`
and `mrv2.platform.triton_interpreter()` (production picks the backend by device alone)."""

from __future__ import annotations

from contextlib import AbstractContextManager

from mrv2 import platform
from mrv2.attention.backend import TORCH, TRITON

# Each backend's kernel family; None = by device.
_IMPL = {TRITON: platform.TRITON, TORCH: platform.CPU, None: None}


def forced_backend(name: str | None) -> AbstractContextManager[None]:
    """Use backend `name` (TRITON or TORCH; None = by device) inside the block. The torch
    backend runs on any device, so the override holds on CUDA tensors too."""
    if name not in _IMPL:
        raise ValueError(f"backend must be {TORCH!r}, {TRITON!r} or None, got {name!r}")
    return platform.forced_impl(_IMPL[name])


def triton_on_cpu() -> AbstractContextManager[None]:
    """The Triton backend on CPU tensors, interpreted (slow: tests with tiny shapes)."""
    return platform.triton_interpreter()
