"""The GGUF tensor types mrv2 computes on as stored: one row each (ggml-cpu's type-traits
table). A row names the type's block geometry, the packed layout its values take in memory
and the decoder from its blocks to that layout's values and tables (gguf_blocks.py); the
kernels of each layout (quantized.py chooses among them once per weight) serve every type of
that layout. Adding a type whose values fit a layout is adding one row.

Layouts: "u4" (values 0..15, two to a byte, a scale and a min per 32 inputs), "i8" (int8
values, a scale and optional min per 16 or 32 inputs; MXFP4's e2m1 levels doubled, its e8m0
scale halved), "f16" / "bf16" (16-bit floats, no groups). Exactness: a row's decoder gives
values and tables whose `scale * q + min` is the type's dequantized value
(tests/models/test_quantized.py checks every row against gguf.quants.dequantize bit for
bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mrv2.models.layers import gguf_blocks


@dataclass(frozen=True)
class QuantFormat:
    name: str  # the GGUF type name
    layout: str  # the packed layout: "u4", "i8", "f16" or "bf16"
    block_size: int  # inputs per block (1 for the 16-bit types)
    block_bytes: int  # bytes per block
    # blocks [nb, block_bytes] uint8 -> (values, scales, mins | None); None for 16-bit types
    decode: Callable[[np.ndarray], gguf_blocks.Blocks] | None = None

    @property
    def is_16bit(self) -> bool:
        return self.decode is None


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("Q4_0", "u4", 32, 18, gguf_blocks.q4_0),
    QuantFormat("Q4_1", "u4", 32, 20, gguf_blocks.q4_1),
    QuantFormat("Q4_K", "u4", 256, 144, gguf_blocks.q4_k),
    QuantFormat("Q8_0", "i8", 32, 34, gguf_blocks.q8_0),
    QuantFormat("Q5_0", "i8", 32, 22, gguf_blocks.q5_0),
    QuantFormat("Q5_1", "i8", 32, 24, gguf_blocks.q5_1),
    QuantFormat("Q5_K", "i8", 256, 176, gguf_blocks.q5_k),
    QuantFormat("Q6_K", "i8", 256, 210, gguf_blocks.q6_k),
    QuantFormat("IQ4_NL", "i8", 32, 18, gguf_blocks.iq4_nl),
    QuantFormat("MXFP4", "i8", 32, 17, gguf_blocks.mxfp4),
    QuantFormat("F16", "f16", 1, 2),
    QuantFormat("BF16", "bf16", 1, 2),
)}


def quant_format(gguf_type: str) -> QuantFormat:
    """The row of `gguf_type`; ValueError naming the accepted types for any other."""
    fmt = FORMATS.get(gguf_type)
    if fmt is None:
        raise ValueError(f"unsupported GGUF type {gguf_type!r}; accepted: {sorted(FORMATS)}")
    return fmt


def packs(gguf_type: str) -> bool:
    """Whether tensors of `gguf_type` are computed on as stored."""
    return gguf_type in FORMATS
