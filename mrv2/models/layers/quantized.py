"""Linear layers computed on GGUF-quantized weights as stored (CPU, float32 activations).

Why: materialising a quantized checkpoint as float32 multiplies its resident size by 4-8x and
makes every decode step stream 4-8x more bytes from DRAM. Here a weight is repacked once at load
into one of two kernel layouts that keep (about) the file's bits per weight:

- "u4": 4-bit values, two per byte (`q` uint8 [N, K // 2], see quantized_numba.py for the nibble
  order), a float32 scale and min per group of 32 inputs: w = scale * q + min.
  Q4_0 (scale d, min -8 d), Q4_1 (d, m), Q4_K (per 32-wide sub-block: d * sc, -dmin * m).
- "i8": int8 values (`q` int8 [N, K]), a float32 scale (and optional min) per group of 32
  (16 for Q6_K): w = scale * q (+ min). Q8_0, Q5_0 (q - 16), Q5_1 (q, min m), Q5_K, Q6_K.
  The 5- and 6-bit types are widened to a byte (1.6x / 1.3x their file size) so that the
  kernels read whole bytes.
- "f16", "bf16": the F16 / BF16 tensors of a GGUF file, kept at 16 bits (`q` int16 [N, K], the
  bit patterns), no groups (`scales` and `mins` None, group size 0): w is the stored value,
  widened to float32 in the kernels.

Exactness: every scale is an f16 (times a 6- or 8-bit integer for the K types), so scale * q is
exact in float32 (<= 11 + 8 + 6 bits) and `dequantize()` rounds once, on the add of the min,
exactly as gguf.quants.dequantize does: the two agree bit for bit (tests/models/test_quantized.py).
A 16-bit weight widens to float32 exactly.

`quantized_linear`: up to `max_gemv_rows` rows of x (decode) run the numba GEMV on the packed
groups; more rows (prefill) dequantize tiles of output rows into a reused float32 buffer and
multiply each with torch.mm, so the float32 weight never exists whole. A 16-bit weight on a CPU
with matrix instructions for its dtype (cpu_linear.computes_natively: AMX or AVX-512 BF16 for
bfloat16) runs on them from MIN_NATIVE_HALF_ROWS rows (the weight packed for oneDNN once).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from mrv2 import platform
from mrv2.models.layers import cpu_linear, dot_linear, quantized_numba
from mrv2.models.layers.cpu_linear import computes_natively
from mrv2.models.layers.quantized_int8_numba import X86_INT8_DOTS

QUANTIZED_GGUF_TYPES: frozenset[str] = frozenset(
    {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"})
# 16-bit float layout -> the torch dtype of its bit patterns; its GGUF type is the layout's
# name upper-cased (F16, BF16).
HALF_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def _gemv_x_format() -> int:
    """How the GEMV on "u4" / "i8" weights takes x (quantized_numba.X_*): where numba compiles
    AVX2's integer multiply-adds, quantized per 32 inputs to int16 (quantized_int16_numba:
    faster than float32 x at 1-32 rows and than int8 x at one row, bench/README.md; an error
    2^-16 of each block's largest input, below a bfloat16 weight's), else float32.
    MRV2_GGUF_ACTIVATIONS=float32 keeps x exact (x @ w.T up to summation order); =int8 is
    llama.cpp's scheme (faster at several rows, but its ~1% rounding moves greedy chat
    completions off float32's, as llama.cpp's does); MRV2_GGUF_INT8_ACTIVATIONS=1, the older
    spelling of int8, still counts."""
    choice = os.environ.get("MRV2_GGUF_ACTIVATIONS", "").strip().lower()
    if not choice and os.environ.get("MRV2_GGUF_INT8_ACTIVATIONS", "0") == "1":
        choice = "int8"
    formats = {"float32": quantized_numba.X_FLOAT32, "int16": quantized_numba.X_INT16,
               "int8": quantized_numba.X_INT8}
    if choice and choice not in formats:
        raise ValueError(f"MRV2_GGUF_ACTIVATIONS={choice!r}: expected one of {sorted(formats)}")
    if not X86_INT8_DOTS:
        return quantized_numba.X_FLOAT32
    return formats[choice or "int16"]


# The x format every GEMV on GGUF blocks uses; the decode stack reads it when it is attached.
GEMV_X_FORMAT: int = _gemv_x_format()
# Rows of x up to which the GEMV beats dequantize-tile + torch.mm (bench/test_quantized_linear.py,
# bench/README.md); the fused decode stack runs up to as many.
MAX_QUANTIZED_GEMV_ROWS = 32
# Rows of x from which a 16-bit weight runs on the CPU's matrix units: from 2 where a few-row
# kernel reads the packed weights (AMX tiles, or AVX-512 BF16's dot_linear: a bf16 model's
# decode step then runs onednn_decode.py as one call, faster than the fused stack's GEMV but
# at 1 row), else from 8 (oneDNN's calls; bench/README.md has each CPU's figures).
MIN_NATIVE_HALF_ROWS = 2 if platform.cpu_has_matrix_tiles() or dot_linear.runs_here() else 8
# Float32 elements of one dequantized tile (1 MiB): stays in L2/L3 while torch.mm reads it.
TILE_ELEMENTS = 1 << 18
# A 16-bit weight widens fast (torch's vectorised copy), so the per-tile cost of torch.mm
# dominates instead: larger tiles (4 MiB) measured faster (bench/README.md).
HALF_TILE_ELEMENTS = 1 << 20
_QK_K = 256  # inputs per K-quant super-block


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 field at byte `start` of each block, as float32 [nb]."""
    return blocks[:, start:start + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[nb, c * width] bytes -> [nb, 2c, width] uint8: each `width` run of bytes gives its low
    nibbles, then its high nibbles (the order of Q4_0/Q4_1/Q5_x (width 16), Q4_K/Q5_K (32))."""
    nb = qs.shape[0]
    qs = qs.reshape(nb, -1, 1, width)
    return ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(nb, -1, width)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes -> the 8 six-bit scales and mins per super-block [nb, 8]."""
    nb = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(nb, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(nb, 8).astype(np.float32), mn.reshape(nb, 8).astype(np.float32)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's little-endian 32-bit qh -> bit 4 of each of the 32 values [nb, 32]."""
    qh = qh.copy().view("<u4").reshape(-1, 1)
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _unpack(b: np.ndarray, gguf_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks [nb, block_bytes] -> (values [nb, block_size] (uint8 for u4 types, int8 else),
    scales [nb, groups], mins [nb, groups] or None), values in input order."""
    nb = b.shape[0]
    if gguf_type == "Q4_0":
        d = _f16(b, 0)[:, None]
        return _nibbles(b[:, 2:], 16).reshape(nb, 32), d, -8.0 * d
    if gguf_type == "Q4_1":
        return _nibbles(b[:, 4:], 16).reshape(nb, 32), _f16(b, 0)[:, None], _f16(b, 2)[:, None]
    if gguf_type == "Q8_0":
        return b[:, 2:].view(np.int8), _f16(b, 0)[:, None], None
    if gguf_type in ("Q5_0", "Q5_1"):
        off = 2 if gguf_type == "Q5_0" else 4
        q = _nibbles(b[:, off + 4:], 16).reshape(nb, 32) | _high_bits(b[:, off:off + 4])
        d = _f16(b, 0)[:, None]
        if gguf_type == "Q5_0":
            return (q.astype(np.int16) - 16).astype(np.int8), d, None
        return q.astype(np.int8), d, _f16(b, 2)[:, None]
    if gguf_type in ("Q4_K", "Q5_K"):
        sc, mn = _k_scale_min(b[:, 4:16])
        scales = _f16(b, 0)[:, None] * sc
        mins = -(_f16(b, 2)[:, None] * mn)
        if gguf_type == "Q4_K":
            return _nibbles(b[:, 16:], 32).reshape(nb, _QK_K), scales, mins
        qh = b[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = _nibbles(b[:, 48:], 32) | ((qh & 1) << 4)
        return q.reshape(nb, _QK_K).astype(np.int8), scales, mins
    if gguf_type == "Q6_K":
        ql = _nibbles(b[:, :128], 64).reshape(nb, 8, 32)
        qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1)
        q = (ql | ((qh & 3).reshape(nb, 8, 32) << 4)).astype(np.int16) - 32
        scales = _f16(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
        return q.reshape(nb, _QK_K).astype(np.int8), scales, None
    raise ValueError(f"unsupported GGUF type {gguf_type!r}; accepted: "
                     f"{sorted(QUANTIZED_GGUF_TYPES)}")


def _compact_tables(scales: np.ndarray, mins: np.ndarray | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 scale / min tables -> int16 float16 bit patterns when every value of both is
    exactly a float16, else float32 (see QuantizedWeight)."""
    tables = [t for t in (scales, mins) if t is not None]
    with np.errstate(over="ignore"):
        exact = all(np.array_equal(t.astype(np.float16).astype(np.float32), t) for t in tables)
    out = [None if t is None else torch.from_numpy(
        np.ascontiguousarray(t.astype(np.float16).view(np.int16) if exact else t))
        for t in (scales, mins)]
    return out[0], out[1]


def _float32_table(table: torch.Tensor) -> torch.Tensor:
    return table.view(torch.float16).float() if table.dtype == torch.int16 else table


def _pack_u4(vals: np.ndarray) -> np.ndarray:
    """Values [N, K] in 0..15 -> the u4 layout [N, K // 2] (byte j of group g: inputs 32 g + j
    low, 32 g + 16 + j high)."""
    v = vals.reshape(vals.shape[0], -1, 2, 16)
    return (v[:, :, 0, :] | (v[:, :, 1, :] << 4)).reshape(vals.shape[0], -1)


class QuantizedWeight:
    """A [out_features, in_features] weight in a packed kernel layout (CPU torch tensors).

    Invariants: in_features % group_size == 0 (integer layouts); `q` is contiguous ([N, K // 2]
    uint8 for "u4", [N, K] int8 for "i8", [N, K] int16 for "f16" / "bf16"); `scales` (and
    `mins` unless None) are contiguous [N, K // G] tables of one dtype: int16 float16 bit
    patterns when every value is exactly a float16 (the 32-input types, whose scales are the
    file's f16 fields: 2 bytes a group instead of 4, and a decode step reads every one),
    float32 otherwise (a K-quant's super-block scale times a 6-bit scale); the 16-bit layouts
    have neither (group size 0).
    """

    def __init__(self, layout: str, group_size: int, q: torch.Tensor,
                 scales: torch.Tensor | None, mins: torch.Tensor | None, gguf_type: str) -> None:
        allowed = {"u4": (32,), "i8": (16, 32), "f16": (0,), "bf16": (0,)}
        if group_size not in allowed.get(layout, ()) or (scales is None) != (group_size == 0):
            raise ValueError(f"bad layout {layout!r} / group size {group_size}")
        self.layout = layout
        self.group_size = group_size
        self.q = q.contiguous()
        self.scales = None if scales is None else scales.contiguous()
        self.mins = None if mins is None else mins.contiguous()
        self.gguf_type = gguf_type
        self._onednn_packed: torch.Tensor | None = None  # a 16-bit weight for oneDNN, once
        self.out_features = int(q.shape[0])
        self.in_features = int(q.shape[1]) * (2 if layout == "u4" else 1)

    @property
    def is_half(self) -> bool:
        """A 16-bit float weight ("f16" / "bf16"), not blocks of integers."""
        return self.layout in HALF_DTYPES

    @classmethod
    def from_gguf(cls, raw: np.ndarray, gguf_type: str,
                  shape: tuple[int, int]) -> QuantizedWeight:
        """Repack a tensor's GGUF bytes (uint8 [N, bytes_per_row], or flat) of `shape` [N, K]."""
        if gguf_type not in QUANTIZED_GGUF_TYPES:
            raise ValueError(f"unsupported GGUF type {gguf_type!r}; accepted: "
                             f"{sorted(QUANTIZED_GGUF_TYPES)}")
        import gguf  # only the load path needs the block sizes

        n, k = shape
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]]
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)  # F16 arrives as float16
        if k % block_size or raw.size != n * (k // block_size) * block_bytes:
            raise ValueError(f"{gguf_type} tensor of shape {shape}: {raw.size} bytes do not "
                             f"make whole {block_size}-input blocks per row")
        if gguf_type.lower() in HALF_DTYPES:
            bits = torch.from_numpy(raw.view(np.int16).reshape(n, k).copy())
            return cls(gguf_type.lower(), 0, bits, None, None, gguf_type)
        blocks = raw.reshape(-1, block_bytes)
        vals, scales, mins = _unpack(blocks, gguf_type)
        vals = vals.reshape(n, k)
        scales = scales.astype(np.float32).reshape(n, -1)
        group = k // scales.shape[1]
        mins = None if mins is None else mins.astype(np.float32).reshape(n, -1)
        scales, mins = _compact_tables(scales, mins)
        if gguf_type in ("Q4_0", "Q4_1", "Q4_K"):
            q, layout = torch.from_numpy(_pack_u4(vals)), "u4"
        else:
            q, layout = torch.from_numpy(np.ascontiguousarray(vals.view(np.int8))), "i8"
        return cls(layout, group, q, scales, mins, gguf_type)

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
        """A [N, K] float weight kept in 16 bits (`dtype` torch.float16 or torch.bfloat16),
        rounded to nearest even as `weight.to(dtype)` does; exact for a weight already
        representable (a bfloat16 checkpoint upcast to float32, say)."""
        layout = next((name for name, d in HALF_DTYPES.items() if d == dtype), None)
        if layout is None or weight.dim() != 2:
            raise ValueError(f"from_float keeps a 2-D weight in float16 or bfloat16, not "
                             f"{dtype} of shape {tuple(weight.shape)}")
        bits = weight.detach().to(dtype).contiguous().view(torch.int16)
        return cls(layout, 0, bits, None, None, layout.upper())

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed weight."""
        tensors = (self.q, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows [start, stop) as a weight that owns its storage (a tensor-parallel shard
        must not keep the whole tensor resident)."""
        if not 0 <= start <= stop <= self.out_features:
            raise ValueError(f"rows [{start}, {stop}) out of [0, {self.out_features})")
        scales, mins = (None if t is None else t[start:stop].clone()
                        for t in (self.scales, self.mins))
        return QuantizedWeight(self.layout, self.group_size, self.q[start:stop].clone(),
                               scales, mins, self.gguf_type)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Concatenate along output rows (fused qkv / gate-up). Parts must share layout, group
        size and in_features (ValueError otherwise); a part without mins gets zero mins when
        another has them."""
        if not parts:
            raise ValueError("cat of no parts")
        first = parts[0]
        for p in parts[1:]:
            if (p.layout, p.group_size, p.in_features) != (
                    first.layout, first.group_size, first.in_features):
                raise ValueError(f"cannot cat {p!r} onto {first!r} (layout/group, K differ)")
        if len({p.scales.dtype for p in parts if p.scales is not None}) > 1:
            parts = [p._with_float32_tables() for p in parts]
        mins = None
        if any(p.mins is not None for p in parts):
            mins = torch.cat([torch.zeros_like(p.scales) if p.mins is None else p.mins
                              for p in parts])
        types = list(dict.fromkeys(p.gguf_type for p in parts))
        scales = None if first.is_half else torch.cat([p.scales for p in parts])
        return QuantizedWeight(first.layout, first.group_size, torch.cat([p.q for p in parts]),
                               scales, mins, "+".join(types))

    @property
    def kernel_mins(self) -> torch.Tensor:
        """`mins` as the kernels take it: the table, or an [N, 0] one of the scales' dtype for
        "no min term" (the same dtype keeps one compiled variant per table dtype)."""
        if self.mins is not None:
            return self.mins
        return torch.empty(self.out_features, 0, dtype=self.scales.dtype)

    def _with_float32_tables(self) -> QuantizedWeight:
        """This weight with float32 scale / min tables (a cat with float32-table parts)."""
        scales, mins = (None if t is None else _float32_table(t) for t in (self.scales, self.mins))
        return QuantizedWeight(self.layout, self.group_size, self.q, scales, mins, self.gguf_type)

    @property
    def half_dtype(self) -> torch.dtype:
        """The float dtype whose bit patterns a 16-bit weight's `q` holds."""
        return HALF_DTYPES[self.layout]

    def onednn_packed(self) -> torch.Tensor:
        """A 16-bit weight in oneDNN's blocked layout (cpu_linear.native_16bit_linear), packed
        at first use (`q` never changes in place)."""
        if self._onednn_packed is None:
            self._onednn_packed = cpu_linear.onednn_pack(self.q.view(self.half_dtype))
        return self._onednn_packed

    def _dequant_into(self, ids: np.ndarray, out: np.ndarray, parallel: bool = True) -> None:
        if self.is_half:  # an exact widening: torch's vectorised conversion does it
            torch.from_numpy(out)[:len(ids)].copy_(self.q[torch.from_numpy(ids)].view(
                self.half_dtype))
            return
        mins = self.kernel_mins
        kernel = quantized_numba.dequant_rows if parallel else quantized_numba.dequant_rows_serial
        kernel(self.q.numpy(), self.scales.numpy(), mins.numpy(), self.layout == "u4",
               self.group_size, ids, out)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` [len(ids), K] (the embedding lookup)."""
        idx = ids.reshape(-1).to(torch.int64).numpy()
        if idx.size and (idx.min() < 0 or idx.max() >= self.out_features):
            raise IndexError(f"row ids outside [0, {self.out_features})")
        out = torch.empty(idx.size, self.in_features, dtype=torch.float32)
        self._dequant_into(np.ascontiguousarray(idx), out.numpy())
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole float32 weight [N, K] (tests and fallbacks; the kernels never need it)."""
        return self.dequantize_rows(torch.arange(self.out_features))

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.gguf_type}, {self.layout}/{self.group_size}, "
                f"[{self.out_features}, {self.in_features}], {self.nbytes} B)")


def max_gemv_rows(weight: QuantizedWeight) -> int:
    """The most rows of x `quantized_linear` multiplies by `weight` on the GEMV kernels
    (`gemv_groups`, `gemv_half`): beyond, on tiles or (16-bit, natively) the matrix units."""
    if weight.is_half and computes_natively(weight.half_dtype):
        return min(MAX_QUANTIZED_GEMV_ROWS, MIN_NATIVE_HALF_ROWS - 1)
    return MAX_QUANTIZED_GEMV_ROWS


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [T, K] (rows may be strided) @ weight^T (+ bias) -> float32 [T, N]."""
    if x.dim() != 2 or x.shape[1] != weight.in_features or x.dtype != torch.float32:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit {weight!r}")
    t, n = x.shape[0], weight.out_features
    if t <= max_gemv_rows(weight):
        out = torch.empty(t, n, dtype=torch.float32)
        x_np = x.detach().contiguous().numpy()
        if weight.is_half:
            quantized_numba.gemv_half(x_np, weight.q.numpy(), weight.layout == "bf16",
                                      out.numpy())
        else:
            # q as bytes for both layouts (the kernel reads each as its layout says), as the
            # decode stack passes it: one compiled variant per table dtype, not two.
            quantized_numba.gemv_groups(x_np, weight.q.view(torch.uint8).numpy(),
                                        weight.scales.numpy(), weight.kernel_mins.numpy(),
                                        weight.layout == "u4", weight.group_size,
                                        GEMV_X_FORMAT, out.numpy())
    elif weight.is_half and computes_natively(weight.half_dtype):
        out = cpu_linear.native_16bit_linear(x.detach(), weight.onednn_packed(), weight.half_dtype)
    else:
        out = _tiled_linear(x.detach(), weight)
    if bias is not None:
        out += bias
    return out


def _tiled_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    # out^T [N, T] is filled tile by tile: its row slices are contiguous, so torch.mm writes
    # them in place; one buffer of <= TILE_ELEMENTS floats (HALF_TILE_ELEMENTS for a 16-bit
    # weight) is reused for every tile. The tile is dequantized on this thread (torch.mm
    # parallelises; see dequant_rows_serial).
    n, k = weight.out_features, weight.in_features
    tile_elements = HALF_TILE_ELEMENTS if weight.is_half else TILE_ELEMENTS
    tile = max(16, min(n, tile_elements // k))
    buf = torch.empty(tile, k, dtype=torch.float32)
    out_t = torch.empty(n, x.shape[0], dtype=torch.float32)
    xt = x.t()
    for n0 in range(0, n, tile):
        rows = min(tile, n - n0)
        if weight.is_half:  # a slice, widened by torch (no gather of row ids)
            buf[:rows].copy_(weight.q[n0:n0 + rows].view(weight.half_dtype))
        else:
            ids = np.arange(n0, n0 + rows, dtype=np.int64)
            weight._dequant_into(ids, buf.numpy(), parallel=False)
        torch.mm(buf[:rows], xt, out=out_t[n0:n0 + rows])
    return out_t.t().contiguous()
