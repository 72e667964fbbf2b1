"""CUDA graphs: batch descriptors, padded dispatch, capture and replay (DESIGN.md section 2)."""

from mrv2.cudagraph.dispatch import BatchDescriptor, CudaGraphDispatcher
from mrv2.cudagraph.manager import CudaGraphManager

__all__ = ["BatchDescriptor", "CudaGraphDispatcher", "CudaGraphManager"]
