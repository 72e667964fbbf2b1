"""Lazy views of a GGUF file's tensors in the form of a safetensors slice (`get_shape()`,
indexing), dequantized to float32 only when read: `GGUFWeight`, one file tensor (llama's
permuted q/k rows and Gemma's 1 + w norms undone on reading), and `DerivedWeight`, a Hugging
Face tensor the converter had reshuffled, rebuilt from one or more file tensors (weights.py
says which tensors are which).

Both keep the stored blocks reachable as `record` (type, torch-order shape, data), which is
what a linear computing on quantized weights takes as it is (models/cpu/quantized_weights.py).
A `DerivedWeight` whose change only moves whole rows, or runs of columns that are whole
blocks, has a record of the moved blocks, bit for bit the file's; any other change (values
mapped, runs cutting blocks apart) makes its record the float32 values, which no quantized
kernel takes: such a weight is dequantized, never requantized.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import torch

from mrv2.models.gguf.checkpoint import GGUFTensorRecord
from mrv2.models.gguf.reader import MappedBytes


def expert_record(record: GGUFTensorRecord, expert: int) -> GGUFTensorRecord:
    """One expert's 2-D tensor of a 3-D experts tensor: its rows of blocks."""
    return dataclasses.replace(record, name=f"{record.name}[{expert}]", shape=record.shape[1:],
                               data=record.data[expert])


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of the llama converter's q/k permutation, per head: its rows
    (h, 2, D/2) -> (h, D/2, 2) order becomes Hugging Face's (h, 2, D/2) again."""
    shape = rows.shape
    per_head = shape[0] // num_heads
    return (rows.reshape(num_heads, per_head // 2, 2, *shape[1:]).swapaxes(1, 2)
            .reshape(shape))


def _owned_float32(values: np.ndarray) -> torch.Tensor:
    # dequantize returns views of the read-only memory map for F32; torch needs its own
    # writable array (the loader copies it into the parameter right away).
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True))


class GGUFWeight:
    """One checkpoint tensor, dequantized to float32 on indexing (rows only, when possible)."""

    def __init__(self, record: GGUFTensorRecord, permuted_heads: int | None = None,
                 offset: float = 0.0) -> None:
        self.record = record
        # Set for a permuted q/k tensor: the number of heads its rows are grouped in.
        self.permuted_heads = permuted_heads
        # Added to every value read: -1 for a norm the converter stored as 1 + w (Gemma's,
        # Qwen3-Next's; the model's norm adds the 1 back in float32, and (1 + w) - 1 is
        # exact there (Sterbenz), so it multiplies by the stored 1 + w bit for bit).
        self.offset = offset

    def get_shape(self) -> list[int]:
        return list(self.record.shape)

    def source_records(self) -> list[GGUFTensorRecord]:
        """The file tensors this weight reads (their pages are dropped once it is loaded)."""
        return [self.record]

    def _rows(self, rows: slice) -> np.ndarray:
        from gguf.quants import dequantize

        record = self.record
        data = record.data if len(record.shape) == 1 else record.data[rows]
        values = dequantize(data, record.tensor_type)
        return values.reshape(-1) if len(record.shape) == 1 else values

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        rows_only = (self.permuted_heads is None and len(self.record.shape) == 2
                     and isinstance(index[0], slice)
                     and all(i == slice(None) for i in index[1:]))
        if rows_only:
            values = self._rows(index[0])
        else:
            values = self._rows(slice(None))
            if self.permuted_heads is not None:
                values = unpermute_rows(values, self.permuted_heads)
            values = values[index]
        out = _owned_float32(values)
        return out + self.offset if self.offset else out


class DerivedWeight(GGUFWeight):
    """A Hugging Face tensor rebuilt from file tensors `sources` (2-D ones of equal width, or
    1-D ones), in this order: their rows stacked and gathered (`rows[i]`: the stack row of
    output row i; None: all, in order), runs of `column_runs[0]` columns reordered (output run
    j is input run `column_runs[1][j]`), values mapped elementwise (`values`, on float32), and
    the result viewed as `shape`, whose first dimension is the rows'."""

    def __init__(self, name: str, sources: Sequence[GGUFTensorRecord], shape: tuple[int, ...],
                 rows: np.ndarray | None = None,
                 column_runs: tuple[int, np.ndarray] | None = None,
                 values: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.name, self.sources, self.shape = name, list(sources), tuple(shape)
        stacked = sum(source.shape[0] for source in self.sources)
        self.rows = np.arange(stacked) if rows is None else np.asarray(rows, dtype=np.int64)
        if len(self.rows) != self.shape[0] or (len(self.rows) and (
                self.rows.min() < 0 or self.rows.max() >= stacked)):
            raise ValueError(f"{name}: {len(self.rows)} rows of {stacked} for shape {shape}")
        self.column_runs, self.values = column_runs, values
        self.permuted_heads, self.offset = None, 0.0

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def source_records(self) -> list[GGUFTensorRecord]:
        return self.sources

    def _gather(self, rows: np.ndarray, stored: bool) -> np.ndarray:
        """The stack's `rows`: the stored data (bytes of blocks, or the values of a float
        type) or float32 values."""
        from gguf.quants import dequantize

        out: np.ndarray | None = None
        start = 0
        for source in self.sources:
            count = source.shape[0]
            picked = (rows >= start) & (rows < start + count)
            if picked.any():
                local = rows[picked] - start
                if stored:
                    part = source.data[local]
                elif len(source.shape) == 1:  # a vector: its values whole, then picked
                    part = dequantize(source.data, source.tensor_type).reshape(-1)[local]
                else:
                    part = dequantize(source.data[local], source.tensor_type)
                if out is None:
                    out = np.empty((len(rows), *part.shape[1:]), part.dtype)
                out[picked] = part
            start += count
        if out is None:  # no rows asked for
            return np.zeros((0, *self.sources[0].data.shape[1:]), np.float32)
        return out

    def _stored_runs(self) -> int | None:
        """A column run's length in the stored data, or None when runs cut blocks apart or
        the sources differ in type (the record is then the float32 values)."""
        from gguf import GGML_QUANT_SIZES

        types = {source.tensor_type for source in self.sources}
        if self.values is not None or len(types) != 1 or len(self.shape) != 2:
            return None
        data = self.sources[0].data
        if self.column_runs is None:
            return 0
        width = self.column_runs[0]
        block, block_bytes = GGML_QUANT_SIZES[types.pop()]
        if width % block:
            return None
        return width // block * block_bytes if data.dtype == np.uint8 else width

    @staticmethod
    def _reorder_runs(data: np.ndarray, run: int, order: np.ndarray) -> np.ndarray:
        rows = data.shape[0]
        return data.reshape(rows, -1, run)[:, order].reshape(rows, -1)

    @property
    def record(self) -> GGUFTensorRecord:  # type: ignore[override]
        first = self.sources[0]
        # Made here, not mapped: nothing of the file to release (nbytes 0).
        unmapped = MappedBytes(first.mapped.mapping, 0, 0)
        run = self._stored_runs()
        if run is None:
            values = self._float(self.rows).reshape(self.shape)
            return GGUFTensorRecord(self.name, _f32_type(), self.shape, values, first.file,
                                    unmapped)
        data = self._gather(self.rows, stored=True)
        if run:
            data = self._reorder_runs(data, run, self.column_runs[1])
        return GGUFTensorRecord(self.name, first.tensor_type, self.shape, data, first.file,
                                unmapped)

    def _float(self, rows: np.ndarray) -> np.ndarray:
        values = np.asarray(self._gather(rows, stored=False), dtype=np.float32)
        if self.column_runs is not None:
            values = self._reorder_runs(values, *self.column_runs)
        if self.values is not None:
            values = self.values(values)
        return values.reshape(len(rows), *self.shape[1:])

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if isinstance(index[0], slice) and all(i == slice(None) for i in index[1:]):
            return _owned_float32(self._float(self.rows[index[0]]))
        return _owned_float32(self._float(self.rows)[index])


def _f32_type() -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType.F32
