"""Staged writes to a persistent per-slot tensor (DESIGN.md invariants 3 and 5).

Python code never writes rows of a persistent tensor one by one. It stages ragged runs
`(row, start, values)` on the host; `apply()` writes all runs of the step with one kernel
launch and forgets them. A later write to the same element wins.

- CPU tensors: one numba kernel copies the runs in staging order (later writes win naturally).
- CUDA tensors: run starts, lengths, value offsets and values are packed into one pinned,
  double-buffered host buffer (`HostStaging`), uploaded with one non_blocking copy and
  scattered by one Triton launch, one program per run. Programs run in any order, so runs that
  overlap (a slot freed and reused within one step) are first deduplicated on the host, element
  by element, keeping the last write.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2 import platform
from mrv2.state.host_staging import HostStaging

# Same-size integer dtypes: kernels copy bits, so one kernel per item size serves every dtype.
_BITS_TORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS_NUMPY = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_MIN_CAPACITY = 64


class StagedWriteTensor:
    """A `[rows, cols]` (or `[rows]`) tensor plus the host-side writes staged for it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dim() not in (1, 2):
            raise ValueError(f"staged tensors are 1-D or 2-D, got shape {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError("staged tensors must be contiguous")
        self.tensor = tensor
        self._num_rows = tensor.shape[0]
        self._num_cols = 1 if tensor.dim() == 1 else tensor.shape[1]
        self._np_dtype = torch.empty((), dtype=tensor.dtype).numpy().dtype
        itemsize = tensor.element_size()
        self._bits_np = _BITS_NUMPY[itemsize]
        self._flat_bits = tensor.view(-1).view(_BITS_TORCH[itemsize])
        self._flat_bits_np = self._flat_bits.numpy() if tensor.device.type == "cpu" else None
        self._numpy = (None if self._flat_bits_np is None else
                       self._flat_bits_np.view(self._np_dtype).reshape(tensor.shape))
        # Staged runs: flat start and length of each, values back to back.
        self._starts = np.empty(_MIN_CAPACITY, dtype=np.int64)
        self._lengths = np.empty(_MIN_CAPACITY, dtype=np.int64)
        self._values = np.empty(_MIN_CAPACITY, dtype=self._np_dtype)
        self._num_runs = 0
        self._num_values = 0
        self._staging: HostStaging | None = None

    @property
    def numpy(self) -> np.ndarray:
        """The CPU tensor as a numpy array (shared memory); CUDA tensors have none."""
        if self._numpy is None:
            raise RuntimeError(f"a tensor on {self.tensor.device} has no numpy view")
        return self._numpy

    def stage_write(self, row: int, start: int, values) -> None:
        values = np.asarray(values, dtype=self._np_dtype).reshape(-1)
        n = len(values)
        if not 0 <= row < self._num_rows:
            raise IndexError(f"row {row} is outside [0, {self._num_rows})")
        if start < 0 or start + n > self._num_cols:
            raise IndexError(f"write of {n} values at column {start} overflows a row "
                             f"of {self._num_cols}")
        if n == 0:
            return
        k, m = self._num_runs, self._num_values
        if k == len(self._starts):
            self._starts = np.resize(self._starts, 2 * k)
            self._lengths = np.resize(self._lengths, 2 * k)
        if m + n > len(self._values):
            self._values = np.resize(self._values, max(2 * len(self._values), m + n))
        self._starts[k] = row * self._num_cols + start
        self._lengths[k] = n
        self._values[m:m + n] = values
        self._num_runs = k + 1
        self._num_values = m + n

    def stage_runs(self, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                   values: np.ndarray) -> None:
        """Stage many runs at once (vectorised): run i writes `lengths[i]` values, taken in
        order from `values`, at `(rows[i], starts[i])`. Same rules as `stage_write`."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = np.asarray(starts, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        values = np.asarray(values, dtype=self._np_dtype).reshape(-1)
        if not len(rows) == len(starts) == len(lengths):
            raise ValueError(f"{len(rows)} rows, {len(starts)} starts, {len(lengths)} lengths")
        if int(lengths.sum()) != len(values):
            raise ValueError(f"lengths add up to {int(lengths.sum())}, got {len(values)} values")
        if len(rows) and ((rows < 0).any() or (rows >= self._num_rows).any()):
            raise IndexError(f"a row is outside [0, {self._num_rows})")
        if len(rows) and ((starts < 0).any() or (lengths < 0).any()
                          or (starts + lengths > self._num_cols).any()):
            raise IndexError(f"a run overflows a row of {self._num_cols}")
        keep = lengths > 0
        if not keep.all():
            rows, starts, lengths = rows[keep], starts[keep], lengths[keep]
        k, m, n = self._num_runs, self._num_values, len(values)
        if k + len(rows) > len(self._starts):
            size = max(2 * len(self._starts), k + len(rows))
            self._starts = np.resize(self._starts, size)
            self._lengths = np.resize(self._lengths, size)
        if m + n > len(self._values):
            self._values = np.resize(self._values, max(2 * len(self._values), m + n))
        self._starts[k:k + len(rows)] = rows * self._num_cols + starts
        self._lengths[k:k + len(rows)] = lengths
        self._values[m:m + n] = values
        self._num_runs = k + len(rows)
        self._num_values = m + n

    def stage_set(self, row: int, value) -> None:
        """Set element `row` of a 1-D tensor (or column 0 of a 2-D one)."""
        self.stage_write(row, 0, (value,))

    def apply(self) -> None:
        """Write every staged run with one kernel launch, then forget them."""
        k, m = self._num_runs, self._num_values
        if k == 0:
            return
        self._num_runs = self._num_values = 0
        starts, lengths = self._starts[:k], self._lengths[:k]
        values = self._values[:m].view(self._bits_np)
        if platform.kernel_impl(self.tensor.device) == platform.CPU:
            from mrv2.state.staged_numba import apply_runs

            apply_runs(self._flat_bits_np, starts, lengths, values)
        else:
            self._apply_triton(starts, lengths, values)

    def _apply_triton(self, starts: np.ndarray, lengths: np.ndarray,
                      values: np.ndarray) -> None:
        from mrv2.state import staged_triton

        if runs_overlap(starts, lengths):
            starts, values = last_write_per_element(starts, lengths, values)
            lengths = np.ones_like(starts)
        k, m = len(starts), len(values)
        meta_bytes = 3 * k * 8
        nbytes = meta_bytes + m * values.itemsize
        if self._staging is None:
            self._staging = HostStaging(self.tensor.device)
        host = self._staging.host_buffer(nbytes)
        meta = host[:meta_bytes].view(np.int64)
        meta[:k] = starts
        meta[k:2 * k] = lengths
        np.cumsum(lengths[:-1], out=meta[2 * k + 1:])
        meta[2 * k] = 0
        host[meta_bytes:nbytes].view(values.dtype)[:] = values
        dev = self._staging.upload(nbytes)
        staged_triton.apply_runs(self._flat_bits, dev[:meta_bytes].view(torch.int64),
                                 dev[meta_bytes:].view(self._flat_bits.dtype), k)


def runs_overlap(starts: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether any two runs `[start, start + length)` share an element."""
    if len(starts) < 2:
        return False
    order = np.argsort(starts, kind="stable")
    sorted_starts = starts[order]
    ends = np.maximum.accumulate(sorted_starts + lengths[order])
    return bool((sorted_starts[1:] < ends[:-1]).any())


def last_write_per_element(starts: np.ndarray, lengths: np.ndarray,
                           values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, values) with one entry per element written: the last staged write."""
    run_offsets = np.cumsum(lengths) - lengths
    index = np.repeat(starts - run_offsets, lengths) + np.arange(len(values))
    unique_index, first_from_end = np.unique(index[::-1], return_index=True)
    return unique_index, values[len(values) - 1 - first_from_end]
