"""Linear layers of many rows (a prompt's) on int8 products: oneDNN's u8 x s8 matmul, on
AVX-512 VNNI or AMX-INT8.

Why: a prompt's linears are bound by arithmetic, and on these CPUs int8 products run at about
twice bfloat16's rate (bench/README.md, "int8 prefill"). A weight of GGUF integer blocks holds,
beside its blocks, an `Int8Weight`: its values (dequantized from the blocks) rounded to int8
with one float32 scale per output row. A step's rows are rounded to int8 with one scale per
row (`int8_rows`), multiplied and summed exactly in int32 by oneDNN, scaled back in float32.

The formats:
- w[n, k] ~ sw[n] * qw[n, k], qw in [-127, 127], sw[n] = max_k |w[n, k]| / 127;
- x[m, k] ~ sx[m] * qx[m, k], qx in [-127, 127], sx[m] = max_k |x[m, k]| / 127; qx enters
  oneDNN as the unsigned byte qx + 128 (VNNI multiplies an unsigned byte by a signed one; a
  signed x took oneDNN's reference path, hundreds of times slower), and the 128 * sum_k qw[n, k]
  that adds is removed by a per-output bias, -128 * sw[n] * sum_k qw[n, k], added in float32
  before the output is rounded (`offset_bias`);
- y[m, n] = sx[m] * (sw[n] * sum_k qx[m, k] qw[n, k]): oneDNN's float32 (the offset bias
  added in float32, its cancellation's error at most a few float32 ulps of 128 sw sum |qw|),
  then multiplied by sx[m] in float32 (`scale_rows`).

Error bound (tests/models/test_int8_linear.py holds it): with |x - sx qx| <= sx / 2 and
|w - sw qw| <= sw / 2 per element,
    |y - x.w| <= sum_k (|x_k| sw / 2 + |w_k| sx / 2 + sx sw / 4) + the float32 terms above
                 + a float32 ulp or two of y,
against the exact product of x and the weight's values. The int32 sums are exact: each is at
most K * 255 * 127, far from 2^31 at any K a model has.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from numba import njit, prange

from mrv2 import cpu_caps
from mrv2.models.layers.cpu_linear import padded_rows
from mrv2.models.layers.numba_exp import exp32
from mrv2.models.layers.numba_rows import CHUNK_ROWS, NUMBA_OPTIONS
from mrv2.models.layers.vector_ir import row_max_abs

# The unsigned byte of qx = 0 (oneDNN's x is u8: qx + 128).
X_OFFSET = 128


@lru_cache(maxsize=None)
def int8_products_run() -> bool:
    """oneDNN multiplies int8 on this CPU's dot-product units (AVX-512 VNNI, or AMX-INT8
    beside it) and torch exposes its quantized linear."""
    ops = getattr(torch.ops, "onednn", None)
    return (cpu_caps.caps().int8_vnni and torch.backends.mkldnn.is_available()
            and ops is not None and hasattr(ops, "qlinear_pointwise"))


@dataclass(frozen=True)
class Int8Weight:
    """A [N, K] weight as oneDNN's packed int8 (`packed`), its per-output-row scales `scales`
    (float32 [N]) and `offset_bias` (float32 [N], -128 * scale * the row's sum of int8
    values: the x offset's contribution, removed)."""

    packed: torch.Tensor
    scales: torch.Tensor
    offset_bias: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def from_row_chunks(cls, chunks: Iterable[torch.Tensor], n: int, k: int) -> Int8Weight:
        """The weight whose float32 rows `chunks` gives in order ([rows, k] each, `n` in all;
        quantized.PackedWeight.float32_row_chunks), each row rounded to nearest at its own
        scale: no float32 copy of the weight whole."""
        q = torch.empty(n, k, dtype=torch.int8)
        scales = torch.empty(n, dtype=torch.float32)
        start = 0
        for rows in chunks:
            stop = start + rows.shape[0]
            # a zero row gets scale 0 and q 0 (its outputs are 0)
            scale = rows.abs().amax(dim=1) / 127
            inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
            q[start:stop] = torch.round(rows * inverse[:, None]).clamp_(-127, 127)
            scales[start:stop] = scale
            start = stop
        if start != n:
            raise ValueError(f"row chunks gave {start} rows, not {n}")
        offset_bias = (-X_OFFSET * scales.double() * q.sum(dim=1, dtype=torch.float64)).float()
        packed = torch.ops.onednn.qlinear_prepack(q, None)
        return cls(packed, scales, offset_bias, n, k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales,
                                                          self.offset_bias))

    @property
    def zero_points(self) -> torch.Tensor:
        """The weight's zero points (symmetric: all 0), as oneDNN takes them."""
        return _zero_points(self.out_features)


@lru_cache(maxsize=64)
def _zero_points(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)


@njit(inline="always", **NUMBA_OPTIONS)
def _quantize_row(x, row, out, r):
    """out[r] = x[row] rounded to int8 at the row's scale, + X_OFFSET; returns the scale."""
    width = x.shape[1]
    largest = row_max_abs(x, row, width)
    scale = largest / np.float32(127.0)
    inverse = np.float32(127.0) / largest if largest > 0 else np.float32(0.0)
    for i in range(width):
        out[r, i] = np.uint8(np.int32(np.rint(x[row, i] * inverse)) + X_OFFSET)
    return scale


@njit(parallel=True, **NUMBA_OPTIONS)
def _quantize_float32(x, out, scales):
    for r in prange(x.shape[0]):
        scales[r] = _quantize_row(x, r, out, r)


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (qx + X_OFFSET as uint8 [padded_rows(M), K], the rows
    below M at the offset (qx = 0); sx float32 [M])."""
    if x.dtype != torch.float32:
        raise ValueError(f"int8 rows from {x.dtype}: expected float32")
    rows, k = x.shape
    out = torch.empty(padded_rows(rows), k, dtype=torch.uint8)
    out[rows:] = X_OFFSET
    scales = torch.empty(rows, dtype=torch.float32)
    _quantize_float32(x.contiguous().numpy(), out.numpy(), scales.numpy())
    return out, scales


@njit(parallel=True, **NUMBA_OPTIONS)
def _scale_float32(y, scales):
    for r in prange(scales.shape[0]):
        s = scales[r]
        for i in range(y.shape[1]):
            y[r, i] *= s


def scale_rows(y: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y[m] *= scales[m] in place (y float32, contiguous, at least len(scales) rows) -> its
    first len(scales) rows."""
    _scale_float32(y.numpy(), scales.numpy())
    rows = scales.shape[0]
    return y[:rows] if y.shape[0] != rows else y


def int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x float32 [M, K] @ weight^T -> float32 [M, N]: x rounded to int8 per row, the products
    summed in int32 (the module's bound)."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit an int8 weight "
                         f"[{weight.out_features}, {weight.in_features}]")
    qx, sx = int8_rows(x)
    return scale_rows(int8_sums(qx, weight), sx)


def int8_sums(qx: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """sw[n] * sum_k qx[m, k] qw[n, k], float32 [padded rows, N], of rows `int8_rows` made
    (not yet times their sx)."""
    if qx.dtype != torch.uint8 or qx.dim() != 2 or qx.shape[1] != weight.in_features:
        raise ValueError(f"int8 rows {tuple(qx.shape)} {qx.dtype} do not fit an int8 weight "
                         f"[{weight.out_features}, {weight.in_features}]")
    # float32 out of oneDNN: asked for bfloat16 it rounds the offset bias to bfloat16 too
    # (half an ulp of 128 * sw * sum qw, however small the output)
    return torch.ops.onednn.qlinear_pointwise(qx, 1.0, 0, weight.packed, weight.scales,
                                              weight.zero_points, weight.offset_bias, 1.0, 0,
                                              torch.float32, "none", [], "")


@njit(parallel=True, **NUMBA_OPTIONS)
def _silu_and_mul_to_int8(sums, scales, width, out, out_scales):
    rows = scales.shape[0]
    for c in prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        act = np.empty((1, width), np.float32)
        for r in range(c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)):
            s = scales[r]
            for i in range(width):
                g = sums[r, i] * s
                act[0, i] = g / (np.float32(1.0) + exp32(-g)) * (sums[r, width + i] * s)
            out_scales[r] = _quantize_row(act, 0, out, r)


def silu_and_mul_int8_rows(sums: torch.Tensor, scales: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated MLP's activation as the next projection's int8 rows: gate/up's `int8_sums`
    [padded rows, 2I] times their rows' `scales` (float32), silu(gate) * up in float32
    (activation_numba's arithmetic), each row rounded to int8 as `int8_rows` rounds it ->
    (uint8 [padded rows, I], float32 [rows])."""
    rows, width = scales.shape[0], sums.shape[1] // 2
    out = torch.empty(padded_rows(rows), width, dtype=torch.uint8)
    out[rows:] = X_OFFSET
    out_scales = torch.empty(rows, dtype=torch.float32)
    _silu_and_mul_to_int8(sums.numpy(), scales.numpy(), width, out.numpy(), out_scales.numpy())
    return out, out_scales
