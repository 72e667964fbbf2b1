"""Staged writes to a persistent per-slot tensor (DESIGN.md invariant 3).

Python code never writes rows of a persistent device tensor one by one. It stages ragged runs
`(row, start, values)` on the host; `apply()` turns all runs of the step into one flat index
vector and one value vector and writes them with a single indexed copy.
"""

from __future__ import annotations

import numpy as np
import torch


class StagedWriteTensor:
    """A `[rows, cols]` (or `[rows]`) device tensor plus the host-side writes staged for it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dim() not in (1, 2):
            raise ValueError(f"staged tensors are 1-D or 2-D, got shape {tuple(tensor.shape)}")
        self.tensor = tensor
        self._flat = tensor.view(-1)
        self._num_cols = 1 if tensor.dim() == 1 else tensor.shape[1]
        self._np_dtype = torch.empty((), dtype=tensor.dtype).numpy().dtype
        self._starts: list[int] = []
        self._values: list[np.ndarray] = []

    def stage_write(self, row: int, start: int, values) -> None:
        values = np.asarray(values, dtype=self._np_dtype).reshape(-1)
        if not 0 <= row < self.tensor.shape[0]:
            raise IndexError(f"row {row} is outside [0, {self.tensor.shape[0]})")
        if start < 0 or start + len(values) > self._num_cols:
            raise IndexError(f"write of {len(values)} values at column {start} overflows a row "
                             f"of {self._num_cols}")
        if len(values):
            self._starts.append(row * self._num_cols + start)
            self._values.append(values)

    def stage_set(self, row: int, value) -> None:
        """Set element `row` of a 1-D tensor (or column 0 of a 2-D one)."""
        self.stage_write(row, 0, [value])

    @property
    def num_staged(self) -> int:
        return len(self._starts)

    def apply(self) -> None:
        """Write every staged run with one indexed copy, then forget them."""
        if not self._starts:
            return
        lengths = np.fromiter((len(v) for v in self._values), dtype=np.int64,
                              count=len(self._values))
        starts = np.asarray(self._starts, dtype=np.int64)
        # Flat index of every value: run start + offset within its run.
        run_offsets = np.cumsum(lengths) - lengths
        index = np.repeat(starts - run_offsets, lengths) + np.arange(lengths.sum())
        values = np.concatenate(self._values)
        # A slot freed and reused within one step is staged twice: the later write wins.
        unique_index, first_from_end = np.unique(index[::-1], return_index=True)
        if len(unique_index) != len(index):
            keep = len(index) - 1 - first_from_end
            index, values = index[keep], values[keep]
        device = self.tensor.device
        self._flat[torch.from_numpy(index).to(device, non_blocking=True)] = (
            torch.from_numpy(values).to(device, non_blocking=True))
        self._starts.clear()
        self._values.clear()
