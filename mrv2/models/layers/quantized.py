"""Linear layers computed on GGUF-quantized weights as stored (CPU, float32 activations).

Why: materialising a quantized checkpoint as float32 multiplies its resident size by 4-8x and
makes every decode step stream 4-8x more bytes from DRAM. Here a weight is repacked once at load
into one of two kernel layouts that keep (about) the file's bits per weight:

- "u4": 4-bit values two per byte (`q` uint8 [N, K // 2], the nibble order in quantized_numba.py),
  a scale and min per group of 32 inputs: w = scale * q + min. Q4_0 (scale d, min -8 d), Q4_1
  (d, m), Q4_K (per 32-wide sub-block: d * sc, -dmin * m).
- "i8": int8 values (`q` int8 [N, K]), a scale (and optional min) per group of 32 (16 for Q6_K):
  Q8_0, Q5_0 (q - 16), Q5_1 (q, min m), Q5_K, Q6_K, IQ4_NL and MXFP4 (its e2m1 levels
  doubled, the e8m0 scale halved: a power of two); the 5- and 6-bit types widened to a byte
  (1.6x / 1.3x their file size) so that the kernels read whole bytes.
- "f16", "bf16": F16 / BF16 tensors kept at 16 bits (`q` int16 [N, K], the bit patterns), no
  groups (`scales`, `mins` None, group size 0), widened to float32 in the kernels.

Exactness: every scale is an f16 (times a 6- or 8-bit integer for the K types), so scale * q is
exact in float32 and `dequantize()` rounds once, on the add of the min, as gguf.quants.dequantize
does: the two agree bit for bit. A 16-bit weight widens to float32 exactly.

`quantized_linear` runs the kernel the weight's `plan` (linear_plan.py, made with the weight)
names for the row count: the numba GEMV on the packed groups for few rows (decode; int16 x on
AVX-512: quantized_panel_numba's panels, held alone from load), quantized_tiles' float32 tiles
and torch.mm for more (prefill); a 16-bit weight on the CPU's matrix units from
linear_plan.MIN_NATIVE_HALF_ROWS rows where it has them for its dtype (the weight packed for
oneDNN once), else, where half_panel_linear's kernel runs (AVX-512), on that kernel at every
row count. Which GGUF types take which layout: quant_formats.FORMATS, one row a type.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from mrv2.models.layers import (cpu_linear, dense_gemv_numba, half_panel_linear,
                                quantized_numba, quantized_panel_layout, quantized_panel_numba,
                                quantized_tiles)
from mrv2.models.layers.cpu_linear import computes_natively
from mrv2.models.layers.gguf_blocks import compact_tables, pack_u4
from mrv2.models.layers.int8_linear import Int8Weight, int8_linear
from mrv2.models.layers.linear_plan import (LinearKernel, panels_plan, plan_for, with_bf16_copy,
                                            with_int8_products)
from mrv2.models.layers.quant_formats import quant_format

# 16-bit float layout -> the torch dtype of its bit patterns; its GGUF type is the layout's
# name upper-cased (F16, BF16).
HALF_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
# Output rows dequantized at a time into a bfloat16 or int8 copy (PackedWeight.hold_*_copy).
COPY_ROWS = 4096


def _float32_table(table: torch.Tensor) -> torch.Tensor:
    return table.view(torch.float16).float() if table.dtype == torch.int16 else table


class PackedWeight:
    """A [out_features, in_features] weight in a packed kernel layout (CPU torch tensors).

    Invariants: in_features % group_size == 0 (integer layouts); `q` is contiguous ([N, K // 2]
    uint8 for "u4", [N, K] int8 for "i8", [N, K] int16 for "f16" / "bf16"); `scales` (and
    `mins` unless None) are contiguous [N, K // G] tables of one dtype: int16 float16 bit
    patterns when every value is exactly a float16 (the 32-input types, whose scales are the
    file's f16 fields: 2 bytes a group instead of 4, and a decode step reads every one),
    float32 otherwise (a K-quant's super-block scale times a 6-bit scale); the 16-bit layouts
    have neither (group size 0).

    Held as its panels (`store_as_panels`, `panel_storage`): `q`, `scales` and `mins` keep their
    dtypes and N rows but no columns; the panels (`panels` or `group_panels`) hold the weight.
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
        self._panels: np.ndarray | None = None  # a 16-bit weight's panels, once
        # integer blocks' panels (quantized_panel_numba), once
        self._group_panels: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.panel_storage = False  # the panels alone hold the weight
        # This weight's bfloat16 copy for many rows (`hold_bf16_copy`), or None.
        self.bf16_copy: PackedWeight | None = None
        # Its int8 copy for a prompt's rows (`hold_int8_copy`), or None.
        self.int8_copy: Int8Weight | None = None
        # Which kernel multiplies by it at each row count: chosen here, once.
        self.plan = plan_for(layout, layout in HALF_DTYPES
                             and computes_natively(HALF_DTYPES[layout]))
        self.out_features = int(q.shape[0])
        self.in_features = int(q.shape[1]) * (2 if layout == "u4" else 1)

    @property
    def is_half(self) -> bool:
        """A 16-bit float weight ("f16" / "bf16"), not blocks of integers."""
        return self.layout in HALF_DTYPES

    @classmethod
    def from_gguf(cls, raw: np.ndarray, gguf_type: str,
                  shape: tuple[int, int]) -> PackedWeight:
        """Repack a tensor's GGUF bytes (uint8 [N, bytes_per_row], or flat) of `shape` [N, K]."""
        fmt = quant_format(gguf_type)
        n, k = shape
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)  # F16 arrives as float16
        if k % fmt.block_size or raw.size != n * (k // fmt.block_size) * fmt.block_bytes:
            raise ValueError(f"{gguf_type} tensor of shape {shape}: {raw.size} bytes do not "
                             f"make whole {fmt.block_size}-input blocks per row")
        if fmt.is_16bit:
            bits = torch.from_numpy(raw.view(np.int16).reshape(n, k).copy())
            return cls(fmt.layout, 0, bits, None, None, gguf_type)
        vals, scales, mins = fmt.decode(raw.reshape(-1, fmt.block_bytes))
        vals = vals.reshape(n, k)
        scales = scales.astype(np.float32).reshape(n, -1)
        group = k // scales.shape[1]
        mins = None if mins is None else mins.astype(np.float32).reshape(n, -1)
        scales, mins = compact_tables(scales, mins)
        if fmt.layout == "u4":
            q = torch.from_numpy(pack_u4(vals))
        else:
            q = torch.from_numpy(np.ascontiguousarray(vals.view(np.int8)))
        return cls(fmt.layout, group, q, scales, mins, gguf_type)

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype) -> PackedWeight:
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
        """Resident bytes: the blocks (or 16-bit values), the panels made of them, a bfloat16
        copy's oneDNN form and an int8 copy's."""
        copy = 0 if self.bf16_copy is None else self.bf16_copy.onednn_packed().nbytes
        if self.int8_copy is not None:
            copy += self.int8_copy.nbytes
        return copy + sum(memory.numel() * memory.element_size()
                          for memory in self.storage_tensors())

    def storage_tensors(self) -> list[torch.Tensor]:
        """The tensors holding the weight (the worker moves them onto huge pages): `q` and the
        tables, and the panels where made (numpy arrays seen as tensors, sharing memory)."""
        tensors = [t for t in (self.q, self.scales, self.mins) if t is not None and t.numel()]
        panels = list(self._group_panels or ()) + ([] if self._panels is None else [self._panels])
        return tensors + [torch.from_numpy(p) for p in panels if p.size]

    def _blocks_held(self, action: str) -> None:
        if self.panel_storage:
            raise ValueError(f"cannot {action} {self!r}: it is held as its panels "
                             f"(split or join weights before store_as_panels)")

    def rows(self, start: int, stop: int) -> PackedWeight:
        """Output rows [start, stop) as a weight that owns its storage (a tensor-parallel shard
        must not keep the whole tensor resident)."""
        self._blocks_held("take rows of")
        if not 0 <= start <= stop <= self.out_features:
            raise ValueError(f"rows [{start}, {stop}) out of [0, {self.out_features})")
        scales, mins = (None if t is None else t[start:stop].clone()
                        for t in (self.scales, self.mins))
        return PackedWeight(self.layout, self.group_size, self.q[start:stop].clone(),
                               scales, mins, self.gguf_type)

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """Concatenate along output rows (fused qkv / gate-up). Parts must share layout, group
        size and in_features (ValueError otherwise); a part without mins gets zero mins when
        another has them."""
        if not parts:
            raise ValueError("cat of no parts")
        first = parts[0]
        for p in parts:
            p._blocks_held("cat")
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
        return PackedWeight(first.layout, first.group_size, torch.cat([p.q for p in parts]),
                               scales, mins, "+".join(types))

    @property
    def kernel_mins(self) -> torch.Tensor:
        """`mins`, or for "no min term" [N, 0] of the scales' dtype (one variant per dtype)."""
        if self.mins is not None:
            return self.mins
        return torch.empty(self.out_features, 0, dtype=self.scales.dtype)

    def _with_float32_tables(self) -> PackedWeight:
        """This weight with float32 scale / min tables (a cat with float32-table parts; the
        decode stack's views of layers whose table dtypes differ), its panels' tables too."""
        scales, mins = (None if t is None else _float32_table(t) for t in (self.scales, self.mins))
        out = PackedWeight(self.layout, self.group_size, self.q, scales, mins, self.gguf_type)
        out.in_features = self.in_features
        if self._group_panels is not None:
            w, panel_scales, panel_mins = self._group_panels
            out._group_panels = (w, *(_float32_table(torch.from_numpy(t)).numpy()
                                      for t in (panel_scales, panel_mins)))
        out.panel_storage, out.plan = self.panel_storage, self.plan
        return out

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

    def panels(self) -> np.ndarray:
        """A 16-bit weight as half_panel_linear's panels, made at first use (`q` never changes
        in place): a copy beside `q` until `store_as_panels`."""
        if self._panels is None:
            self._panels = half_panel_linear.panels_of(self.q)
        return self._panels

    def group_panels(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A weight of integer blocks as quantized_panel_numba's panels (weights, scales,
        mins; the tables in this weight's table dtype), made at first use (`q` and the tables
        never change in place): a copy beside the blocks until `store_as_panels`."""
        if self._group_panels is None:
            self._group_panels = quantized_panel_layout.group_panels_of(
                self.q.numpy(), self.scales.numpy(),
                None if self.mins is None else self.mins.numpy(), packed=self.layout == "u4")
        return self._group_panels

    def store_as_panels(self) -> None:
        """Hold this weight as its panels alone (a model's linear, at load, where its plan
        runs a panel kernel: `plan.on_panels`): a 16-bit weight as `panels`, integer blocks as
        `group_panels`. `q` and the tables are released; the kernels, the float32 rows
        (`dequantize_rows`) and the prefill tiles read the panels; `rows` and `cat` no longer
        apply; the plan becomes the panels' (`linear_plan.panels_plan`)."""
        if self.is_half:
            if not half_panel_linear.panels_run_here():
                raise ValueError("the 16-bit panel kernel does not run on this CPU (AVX-512)")
            self.panels()
        else:
            if self.layout not in ("i8", "u4"):
                raise ValueError(f"{self!r}: only 16-bit weights and integer blocks are held "
                                 f"as panels")
            if not quantized_panel_numba.GROUP_PANELS_RUN:
                raise ValueError("the group panel kernel does not run on this CPU (AVX-512 BW)")
            self.group_panels()
        n = self.out_features
        self.q = self.q.new_empty(n, 0)
        self.scales, self.mins = (None if t is None else t.new_empty(n, 0)
                                  for t in (self.scales, self.mins))
        self.panel_storage = True
        self.plan = panels_plan(self.plan)

    def float32_row_chunks(self) -> Iterator[torch.Tensor]:
        """This weight's float32 rows, COPY_ROWS at a time (one buffer, overwritten: each chunk
        is valid until the next is asked for)."""
        n, k, chunk = self.out_features, self.in_features, COPY_ROWS
        buffer = np.empty((min(n, chunk), k), np.float32)
        for start in range(0, n, chunk):
            ids = np.arange(start, min(n, start + chunk), dtype=np.int64)
            self.dequantize_rows_into(ids, buffer)
            yield torch.from_numpy(buffer[:len(ids)])

    def hold_bf16_copy(self) -> None:
        """Also hold this weight (integer blocks, or float16 the matrix units do not take)
        dequantized to bfloat16 (each value rounded to nearest even once), oneDNN-packed
        alone, for the rows its plan gives the matrix units (linear_plan.with_bf16_copy): a
        default GGUF model on a CPU that multiplies bfloat16 natively reads the weight as
        stored at a few rows and the copy at many (quantized_weights.pack_gguf_weights).
        Dequantized `COPY_ROWS` rows at a time: the load holds no float32 copy of it whole."""
        # Refuses a weight the matrix units take already.
        plan = with_bf16_copy(self.plan, self.plan.few is LinearKernel.GROUP_PANELS
                              and quantized_panel_numba.panels_prefetch(
                                  self.group_panels()[0].shape[2]))
        n, k = self.out_features, self.in_features
        values = torch.empty(n, k, dtype=torch.bfloat16)
        start = 0
        for rows in self.float32_row_chunks():
            values[start:start + rows.shape[0]] = rows
            start += rows.shape[0]
        copy = PackedWeight.from_float(values, torch.bfloat16)
        copy.onednn_packed()
        copy.q = copy.q.new_empty(n, 0)  # the oneDNN form alone holds it
        self.bf16_copy, self.plan = copy, plan

    def hold_int8_copy(self) -> None:
        """Also hold this weight of integer blocks, beside its bfloat16 copy, rounded to int8
        per output row (int8_linear.Int8Weight), for the prompt rows its plan gives int8
        products (linear_plan.with_int8_products)."""
        plan = with_int8_products(self.plan)  # refuses a weight without blocks and a copy
        self.int8_copy = Int8Weight.from_row_chunks(self.float32_row_chunks(),
                                                    self.out_features, self.in_features)
        self.plan = plan

    @property
    def many_rows_half(self) -> PackedWeight:
        """The 16-bit weight the matrix units multiply (NATIVE_16BIT): this one, or its
        bfloat16 copy."""
        return self if self.bf16_copy is None else self.bf16_copy

    def dequantize_rows_into(self, ids: np.ndarray, out: np.ndarray, parallel: bool = True
                             ) -> None:
        """out[:len(ids)] = float32 rows `ids` (int64, in range); `parallel`: on numba's
        threads, else the calling thread's."""
        if self.is_half:  # an exact widening: torch's vectorised conversion does it
            if self.panel_storage:  # panel b, input k, lane o: output 64 b + o
                width = half_panel_linear.PANEL_OUTPUTS
                bits = torch.from_numpy(self._panels[ids // width, :, ids % width])
            else:
                bits = self.q[torch.from_numpy(ids)]
            torch.from_numpy(out)[:len(ids)].copy_(bits.view(self.half_dtype))
            return
        if self.panel_storage:
            quantized_panel_layout.panel_rows(*self._group_panels, self.layout == "u4", ids, out)
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
        self.dequantize_rows_into(np.ascontiguousarray(idx), out.numpy())
        return out

    def __repr__(self) -> str:
        return (f"PackedWeight({self.gguf_type}, {self.layout}/{self.group_size}, "
                f"[{self.out_features}, {self.in_features}], {self.nbytes} B)")


def quantized_linear(x: torch.Tensor, weight: PackedWeight,
                     bias: torch.Tensor | None = None, float32_sums: bool = False) -> torch.Tensor:
    """x float32 [T, K] (rows may be strided) @ weight^T (+ bias) -> float32 [T, N];
    `float32_sums` (logits): never rounded to a 16-bit weight's dtype on the matrix units."""
    if x.dim() != 2 or x.shape[1] != weight.in_features or x.dtype != torch.float32:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit {weight!r}")
    t, n = x.shape[0], weight.out_features
    kernel = weight.plan.kernel_for(t)
    if kernel is LinearKernel.HALF_PANELS:
        out = half_panel_linear.half_panel_linear(x.detach(), weight.panels(),
                                                  weight.layout == "bf16", n)
    elif kernel is LinearKernel.NATIVE_16BIT:
        half = weight.many_rows_half
        out = cpu_linear.native_16bit_linear(x.detach(), half.onednn_packed(), half.half_dtype,
                                             float32_sums)
    elif kernel is LinearKernel.INT8_PRODUCTS:
        out = int8_linear(x.detach(), weight.int8_copy)
    elif kernel in (LinearKernel.BLOCK_TILES, LinearKernel.BLOCK_TILES_BF16):
        out = quantized_tiles.tiled_linear(x.detach(), weight, torch.bfloat16 if kernel is
                                           LinearKernel.BLOCK_TILES_BF16 else torch.float32)
    else:
        out = torch.empty(t, n, dtype=torch.float32)
        x_np = x.detach().contiguous().numpy()
        if kernel in (LinearKernel.HALF_GEMV, LinearKernel.HALF_PAIRS):
            gemv = (dense_gemv_numba.gemv_half if kernel is LinearKernel.HALF_GEMV
                    else dense_gemv_numba.gemv_half_pairs)
            gemv(x_np, weight.q.numpy(), weight.layout == "bf16", out.numpy())
        elif kernel is LinearKernel.GROUP_PANELS:
            quantized_panel_numba.group_panel_kernel(x_np, *weight.group_panels(),
                                                     weight.layout == "u4", out.numpy())
        else:
            # q as bytes for both layouts (the kernel reads each as its layout says), as the
            # decode stack passes it: one compiled variant per table dtype, not two.
            quantized_numba.gemv_groups(x_np, weight.q.view(torch.uint8).numpy(),
                                        weight.scales.numpy(), weight.kernel_mins.numpy(),
                                        weight.layout == "u4", weight.group_size,
                                        weight.plan.x_format, out.numpy())
    if bias is not None:
        out += bias
    return out
