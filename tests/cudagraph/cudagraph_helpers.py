"""Views of the CUDA-graph dispatch table and manager that only tests read."""

from __future__ import annotations

from mrv2.cudagraph import CudaGraphDispatcher, CudaGraphManager


def max_capture_size(dispatcher: CudaGraphDispatcher) -> int:
    """Largest num_tokens any graph serves (0: none)."""
    return max((d.num_tokens for d in dispatcher.descriptors), default=0)


def captured(manager: CudaGraphManager) -> bool:
    """Whether `capture` recorded any graph (never on CPU or in mode "NONE")."""
    return bool(manager._graphs)
