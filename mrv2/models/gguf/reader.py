"""One GGUF file's layout, read in one pass: metadata as Python values, tensors as views of one
memory map. The result equals what `gguf.GGUFReader` gives (`ReaderField.contents()` of each
field; each tensor's type, dimensions and data array), and the `gguf` package stays the
source of the format's types and block sizes.

Why not GGUFReader itself: it makes numpy views of every part of every value, so a real
tokenizer's metadata (SmolLM2: 49,152 tokens and 48,900 merges) takes ~4 s to open, paid by
every process that opens the file (the API server, the engine core, each worker). Here a
string is one struct read and one decode.

Layout (GGUF v2 / v3, either byte order): magic "GGUF", version u32, tensor count u64, metadata
count u64; each metadata pair (key string, value type u32, value); each tensor's info (name,
n_dims u32, dims u64 fastest first, type u32, offset u64 from the data start); the data start at
the next multiple of `general.alignment` (default 32). A string is a u64 byte length and UTF-8
bytes; an array is an element type u32, a u64 count and the elements.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUFValueType -> struct format of one scalar (STRING 8 and ARRAY 9 are read apart).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types whose data GGUFReader types by value (every other type: rows of block bytes).
_VALUE_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class MappedBytes:
    """Where one tensor's bytes lie in its file's (read-only) memory map."""

    mapping: mmap.mmap
    start: int
    nbytes: int

    def release(self) -> None:
        """Drop these bytes' pages from the process's resident memory. A mapped file's pages
        count in its RSS once read, until unmapped, though a loaded tensor's values live on
        in the parameter or packed weight they were copied into: without this, loading holds
        a second copy of the checkpoint. The pages stay in the page cache, and a later read
        faults them back in (the mapping is read-only: nothing is lost; the same holds for
        the edge pages a neighbouring tensor shares). Nothing happens where madvise is not
        available."""
        if self.nbytes == 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = self.start - self.start % mmap.PAGESIZE  # madvise takes whole pages
        self.mapping.madvise(mmap.MADV_DONTNEED, first, self.start + self.nbytes - first)


@dataclass(frozen=True)
class GGUFFileTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order: fastest-varying first
    # A read-only view of the file: the values ([dims reversed]) for the value-typed types,
    # otherwise uint8 rows of blocks ([..., bytes per row]).
    data: np.ndarray
    mapped: MappedBytes  # the bytes `data` views


@dataclass(frozen=True)
class GGUFFile:
    version: int
    fields: dict[str, Any]
    tensors: list[GGUFFileTensor]


class _Cursor:
    def __init__(self, buffer: memoryview, order: str) -> None:
        self.buffer, self.order, self.offset = buffer, order, 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(self.order + fmt, self.buffer, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"a string of {length} bytes at offset {self.offset} runs past the "
                             f"end of the file")
        text = str(self.buffer[self.offset:end], "utf-8")
        self.offset = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            return self.array(item_type, count)
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {value_type} at offset "
                             f"{self.offset - 4}")
        return self.scalar(fmt)

    def array(self, item_type: int, count: int) -> list[Any]:
        fmt = _SCALAR_FORMATS.get(item_type)
        if fmt is None:  # strings, nested arrays: one at a time
            return [self.value(item_type) for _ in range(count)]
        size = struct.calcsize(fmt) * count
        if self.offset + size > len(self.buffer):
            raise ValueError(f"an array of {count} items at offset {self.offset} runs past the "
                             f"end of the file")
        dtype = np.dtype(np.bool_ if fmt == "?" else self.order + fmt)
        values = np.frombuffer(self.buffer, dtype, count, self.offset).tolist()
        self.offset += size
        return values


def read_gguf_file(path: str | os.PathLike[str]) -> GGUFFile:
    """The metadata and tensors of the GGUF file at `path` (memory-mapped: no tensor data is
    read). Raises ValueError for anything that is not a well-formed GGUF v2 / v3 file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as file:  # the mapping outlives the descriptor
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = np.frombuffer(mapping, dtype=np.uint8)
    buffer = memoryview(mapped)
    if bytes(buffer[:4]) != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    try:
        order = "<"
        version = struct.unpack_from("<I", buffer, 4)[0]
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            order = ">"
            version = struct.unpack_from(">I", buffer, 4)[0]
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} (readable: {SUPPORTED_VERSIONS})")
        cursor = _Cursor(buffer, order)
        cursor.offset = 8
        num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string()
            if key in fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            fields[key] = cursor.value(cursor.scalar("I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
            infos.append((name, dims, cursor.scalar("I"), cursor.scalar("Q")))
    except struct.error:
        raise ValueError(f"the header ends early: the file has {len(buffer)} bytes") from None
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment={alignment!r}: not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        tensor_type = GGMLQuantizationType(raw_type)
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        num_elements = int(np.prod(dims, dtype=np.int64))
        shape = tuple(reversed(dims))
        value_dtype = _VALUE_DTYPES.get(tensor_type.name)
        if value_dtype is None:
            dtype = np.dtype(np.uint8)
            shape = (*shape[:-1], shape[-1] // block * block_bytes)
        else:
            dtype = np.dtype(value_dtype).newbyteorder(order)
        start = data_start + offset
        nbytes = num_elements // block * block_bytes
        if start + nbytes > len(buffer):
            raise ValueError(f"tensor {name!r}: its {nbytes} bytes at offset {start} run past "
                             f"the end of the file ({len(buffer)} bytes); the file is truncated")
        # A plain ndarray (not np.memmap: its per-slice bookkeeping made loading slow) whose
        # base keeps the mapping open.
        data = np.ndarray(shape, dtype, mapped, start)
        tensors.append(GGUFFileTensor(name, tensor_type, dims, data,
                                      MappedBytes(mapping, start, nbytes)))
    return GGUFFile(version, fields, tensors)
