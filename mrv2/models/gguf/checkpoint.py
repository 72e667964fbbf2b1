"""One GGUF checkpoint on disk: its file(s), metadata and tensor records, read with
`reader.read_gguf_file` (memory-mapped: no tensor data is read here).

A split checkpoint (llama.cpp's `gguf-split`: `name-00001-of-00003.gguf`, ...) is named by any
of its files and read as one: metadata from the first file, tensors from all of them, each file's
`split.no` / `split.count` checked. A checkpoint is opened once per process and shared by the
config, tokenizer and weight loaders (`open_gguf`).

Whatever is wrong with a file (not GGUF, truncated, a tensor type the `gguf` package cannot
dequantize) is a `GGUFError` naming the file, raised here, before any model is built.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mrv2.models.gguf.reader import GGUFFileTensor, MappedBytes, read_gguf_file

GGUF_SUFFIX = ".gguf"
# llama.cpp's split naming (gguf.SHARD_NAME_FORMAT without the stem): "-00001-of-00003.gguf".
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """A GGUF file is unreadable, truncated, incomplete or holds something mrv2 cannot load."""


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    """True for a path that names a GGUF file (by its suffix; it need not exist)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


def split_files(path: str | os.PathLike[str]) -> list[Path]:
    """Every file of the checkpoint `path` names, in split order (one file when not split)."""
    path = Path(path)
    match = _SPLIT_RE.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    files = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise GGUFError(f"{path}: split GGUF checkpoint of {count} files is incomplete; "
                        f"missing {missing}")
    return files


@dataclass(frozen=True)
class GGUFTensorRecord:
    """Where one tensor lives: `data` is a memory map of its stored bytes (uint8 rows of blocks
    for quantized types, the values themselves for F32/F16/BF16)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: (rows, columns) for a matrix
    data: np.ndarray
    file: Path
    mapped: MappedBytes  # the bytes `data` views

    @property
    def type_name(self) -> str:
        return self.tensor_type.name

    def release_pages(self) -> None:
        """Drop the tensor's file pages from the process's resident memory once its values
        were copied (reader.MappedBytes.release); `data` stays readable."""
        self.mapped.release()


class GGUFCheckpoint:
    """Metadata (`fields`: key -> Python value) and tensors (`tensors`: name -> record)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {str(self.path)!r} does not exist")
        self.files = split_files(self.path)
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorRecord] = {}
        for number, file in enumerate(self.files, start=1):
            try:
                gguf_file = read_gguf_file(file)
            except Exception as error:  # noqa: BLE001 - any parse failure means a bad file
                raise GGUFError(f"{file}: not a readable GGUF file ({type(error).__name__}: "
                                f"{error}); the file may be truncated or corrupt") from None
            fields = gguf_file.fields
            self._check_split(file, fields, number)
            if number == 1:
                self.fields = fields
            for tensor in gguf_file.tensors:
                self._add_tensor(file, tensor)
        expected = self.fields.get("split.tensors.count")
        if expected is not None and expected != len(self.tensors):
            raise GGUFError(f"{self.path}: the split holds {len(self.tensors)} tensors, its "
                            f"metadata says {expected}")

    def _check_split(self, file: Path, fields: dict[str, Any], number: int) -> None:
        count = fields.get("split.count", 1)
        if count != len(self.files) or fields.get("split.no", 0) != number - 1:
            raise GGUFError(f"{file}: split metadata says file {fields.get('split.no', 0) + 1} "
                            f"of {count}, but it is file {number} of {len(self.files)} by name")

    def _add_tensor(self, file: Path, tensor: GGUFFileTensor) -> None:
        from gguf import GGML_QUANT_SIZES

        name = tensor.name
        if name in self.tensors:
            raise GGUFError(f"{file}: tensor {name!r} appears twice in the checkpoint")
        if not dequantizable(tensor.tensor_type):
            raise GGUFError(f"{file}: tensor {name!r} has type {tensor.tensor_type.name}, which "
                            f"the installed gguf package cannot dequantize")
        # GGUF stores dimensions fastest-first; torch order is the reverse.
        shape = tuple(reversed(tensor.dims))
        block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        expected = int(np.prod(shape)) // block * block_bytes
        if tensor.data.nbytes != expected:
            raise GGUFError(f"{file}: tensor {name!r} has {tensor.data.nbytes} bytes of data, "
                            f"{expected} expected; the file is truncated or corrupt")
        self.tensors[name] = GGUFTensorRecord(name, tensor.tensor_type, shape, tensor.data, file,
                                              tensor.mapped)

    @property
    def architecture(self) -> str:
        arch = self.fields.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture in the metadata")
        return arch

    def f32_vector(self, name: str, length: int) -> list[float]:
        """A 1-D tensor of the file (rope factors) as floats, checked to hold `length` values."""
        from gguf.quants import dequantize

        record = self.tensors.get(name)
        if record is None:
            raise GGUFError(f"{self.path}: no {name} tensor")
        values = dequantize(record.data, record.tensor_type).reshape(-1)
        if values.shape[0] != length:
            raise GGUFError(f"{self.path}: {name} has {values.shape[0]} entries, {length} "
                            f"expected")
        return np.asarray(values, dtype=np.float32).tolist()

    def arch_field(self, key: str, default: Any = None) -> Any:
        """A `gguf.Keys` field with `{arch}` filled in, e.g. Keys.LLM.BLOCK_COUNT."""
        return self.fields.get(key.format(arch=self.architecture), default)

    def require(self, key: str) -> Any:
        """A field that must be present (architecture keys take `{arch}`)."""
        value = self.arch_field(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key.format(arch=self.architecture)!r} "
                            f"is missing")
        return value


@functools.lru_cache(maxsize=None)
def dequantizable(tensor_type: Any) -> bool:
    """Whether `gguf.quants.dequantize` implements this type (asked with one zero block)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    if tensor_type not in GGML_QUANT_SIZES:
        return False
    block_bytes = GGML_QUANT_SIZES[tensor_type][1]
    try:
        dequantize(np.zeros((1, block_bytes), dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, stamp: tuple[tuple[int, int], ...]) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def open_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """The checkpoint at `path`, parsed once per process while its files stay unchanged."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file {path!r} does not exist")
    stamp = tuple((st.st_size, st.st_mtime_ns) for st in (os.stat(f) for f in split_files(path)))
    return _open_cached(path, stamp)
