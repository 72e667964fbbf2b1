"""Which kernel multiplies by a packed weight (GGUF blocks or 16-bit), chosen once per weight.

A `LinearPlan` is made when a `quantized.PackedWeight` is (from its layout and this CPU's
capabilities) and carried with it: `quantized_linear` (the module path), the fused decode
stack's views (models/cpu/decode.py), the LM head in the stack (`numba_rows`) and the choice to
hold a weight as its panels (`on_panels`) all read it, so they agree by construction. The row
bands and the activation format live here, beside the choice they make; the kernels live in
their own modules (named on each `LinearKernel`).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, replace

from mrv2 import batch_invariant, cpu_caps
from mrv2.models.layers import dot_linear, half_panel_linear, quantized_numba
from mrv2.models.layers import quantized_panel_numba
from mrv2.models.layers.quantized_int8_numba import X86_INT8_DOTS


class LinearKernel(enum.Enum):
    HALF_GEMV = "half_gemv"  # dense_gemv_numba.gemv_half: 16-bit values widened, float32 sums
    HALF_PAIRS = "half_pairs"  # dense_gemv_numba.gemv_half_pairs: the same, in register blocks
    HALF_PANELS = "half_panels"  # half_panel_linear: 16-bit output panels, any row count
    NATIVE_16BIT = "native_16bit"  # cpu_linear.native_16bit_linear: AMX / AVX-512 BF16 / oneDNN
    BLOCK_GEMV = "block_gemv"  # quantized_numba.gemv_groups: integer blocks as stored
    GROUP_PANELS = "group_panels"  # quantized_panel_numba: blocks on output panels, int16 x
    BLOCK_TILES = "block_tiles"  # quantized_tiles: float32 tiles of the blocks + torch.mm
    BLOCK_TILES_BF16 = "block_tiles_bf16"  # quantized_tiles: the tiles in bfloat16, x too
    INT8_PRODUCTS = "int8_products"  # int8_linear: int8 rows and weight rows, oneDNN


# The kernels numba code (the fused decode stack) calls as the module path does.
NUMBA_KERNELS = frozenset({LinearKernel.HALF_GEMV, LinearKernel.HALF_PAIRS,
                           LinearKernel.HALF_PANELS, LinearKernel.BLOCK_GEMV,
                           LinearKernel.GROUP_PANELS})


def _gemv_x_format() -> int:
    """How the GEMV on "u4" / "i8" weights takes x (quantized_numba.X_*): where numba compiles
    AVX2's integer multiply-adds, int16 per 32 inputs (quantized_int16_numba: an error 2^-16 of
    each block's largest input), else float32. MRV2_GGUF_ACTIVATIONS=float32 keeps x exact;
    =int8 is llama.cpp's scheme (its ~1% rounding moves greedy outputs off float32's, as
    llama.cpp's does); cpu_caps reads the switch (and its older spelling) and checks it."""
    choice = cpu_caps.caps().gguf_activations
    formats = {"float32": quantized_numba.X_FLOAT32, "int16": quantized_numba.X_INT16,
               "int8": quantized_numba.X_INT8}
    if not X86_INT8_DOTS:
        return quantized_numba.X_FLOAT32
    return formats[choice or "int16"]


# The x format of the GEMV on GGUF blocks, read into each plan when its weight is made.
GEMV_X_FORMAT: int = _gemv_x_format()
# Rows of x up to which the GEMV beats dequantize-tile + torch.mm (bench/test_quantized_linear.py,
# bench/README.md); the fused decode stack runs up to as many.
MAX_QUANTIZED_GEMV_ROWS = 32
# Rows of x from which a 16-bit weight runs on the CPU's matrix units: from 2 where a few-row
# kernel reads the packed weights (AMX tiles, or AVX-512 BF16's dot_linear: a bf16 model's
# decode step then runs onednn_decode.py as one call, faster than the fused stack's GEMV but
# at 1 row), else from 8 (oneDNN's calls; bench/README.md has each CPU's figures).
MIN_NATIVE_HALF_ROWS = 2 if cpu_caps.caps().matrix_tiles or dot_linear.runs_here() else 8
# Rows of x from which a 16-bit weight's GEMV takes its weight rows in pairs (gemv_half_pairs),
# where neither matrix units nor 16-bit panels run (AVX2): bound by arithmetic from here, by
# reading the weights below; up to MAX_HALF_PAIRS_ROWS, past which the float32 tiles and
# torch.mm are faster (a prompt chunk; bench/README.md).
MIN_HALF_PAIRS_ROWS = 8
MAX_HALF_PAIRS_ROWS = 128
# Rows of x up to which a GGUF weight that also holds a bfloat16 copy (`with_bf16_copy`) runs
# as stored; more run on the copy on the matrix units. Group panels (integer blocks, int16 x)
# whose passes of several rows prefetch the weight stream ("u4", "i8":
# quantized_panel_numba.panels_prefetch) keep up to 8 where the CPU has no matrix tiles: on
# Zen 4 they beat oneDNN's bfloat16 copy at 5 rows and tied or won at 8 (SmolLM2 Q4_1 and
# Q8_0, a 40M Q4_0). Other kernels and forms (the F16 panels, "u6" / "u4k" panels, the GEMV on
# the rows), and the AMX units' tiles, keep the copy from 5 rows (bench/README.md, issue 51).
MAX_BLOCK_ROWS_BESIDE_COPY = 4
MAX_GROUP_PANEL_ROWS_BESIDE_COPY = 4 if cpu_caps.caps().matrix_tiles else 8
# Rows of x from which a weight of integer blocks that also holds an int8 copy
# (`with_int8_products`) runs on int8 products: a prompt chunk's rows. Decode steps up to
# onednn_decode's 64 rows stay on the bfloat16 copy, where that path and the layer path agree.
MIN_INT8_ROWS = 65


@dataclass(frozen=True)
class LinearPlan:
    """`few` multiplies up to `few_rows` rows of x, `mid` (where set) the rows after it up to
    `mid_rows`, `many` more; `x_format` is the GEMV's x format on integer blocks
    (quantized_numba.X_*)."""

    few: LinearKernel
    few_rows: int
    many: LinearKernel
    x_format: int = quantized_numba.X_FLOAT32
    mid: LinearKernel | None = None
    mid_rows: int = 0

    def kernel_for(self, rows: int) -> LinearKernel:
        if rows <= self.few_rows:
            return self.few
        return self.mid if self.mid is not None and rows <= self.mid_rows else self.many

    @property
    def on_panels(self) -> bool:
        """The weight is held as its panels alone (its few-row kernel reads panels)."""
        return self.few in (LinearKernel.HALF_PANELS, LinearKernel.GROUP_PANELS)

    @property
    def numba_rows(self) -> int:
        """The most rows the fused decode stack computes as `quantized_linear` does: the
        numba kernels' rows, at most the GEMV's (MAX_QUANTIZED_GEMV_ROWS)."""
        if self.few not in NUMBA_KERNELS:
            return 0
        if self.mid in NUMBA_KERNELS:
            return min(self.mid_rows, MAX_QUANTIZED_GEMV_ROWS)
        return self.few_rows

    @property
    def native_from(self) -> int:
        """The first row count this plan runs on the matrix units (NATIVE_16BIT); never
        where it has no such band."""
        if self.mid is LinearKernel.NATIVE_16BIT:
            return self.few_rows + 1
        if self.many is not LinearKernel.NATIVE_16BIT:
            return sys.maxsize
        return (self.mid_rows if self.mid is not None else self.few_rows) + 1

    @property
    def pairs_from(self) -> int:
        """The first row count the GEMV on a 16-bit weight pairs its rows at (HALF_PAIRS), as
        the fused stack reads it; never where the plan has no such band."""
        return self.few_rows + 1 if self.mid is LinearKernel.HALF_PAIRS else sys.maxsize


def plan_for(layout: str, native_16bit: bool) -> LinearPlan:
    """The plan of a weight of `layout` ("u4", "i8", "f16", "bf16"); `native_16bit`: this CPU
    multiplies the 16-bit layout's dtype on matrix units (cpu_linear.computes_natively). In
    batch-invariant mode the few-row kernel (each row's sums in one fixed order, whatever the
    other rows and the threads) runs every row count."""
    plan = _fastest_plan(layout, native_16bit)
    if batch_invariant.active():
        return LinearPlan(plan.few, sys.maxsize, plan.few, plan.x_format)
    return plan


def _fastest_plan(layout: str, native_16bit: bool) -> LinearPlan:
    if layout in ("f16", "bf16"):
        if native_16bit:
            return LinearPlan(LinearKernel.HALF_GEMV,
                              min(MAX_QUANTIZED_GEMV_ROWS, MIN_NATIVE_HALF_ROWS - 1),
                              LinearKernel.NATIVE_16BIT)
        if half_panel_linear.panels_run_here():  # every row count: panels beat tiles here
            return LinearPlan(LinearKernel.HALF_PANELS, MAX_QUANTIZED_GEMV_ROWS,
                              LinearKernel.HALF_PANELS)
        return LinearPlan(LinearKernel.HALF_GEMV, MIN_HALF_PAIRS_ROWS - 1,
                          LinearKernel.BLOCK_TILES, mid=LinearKernel.HALF_PAIRS,
                          mid_rows=MAX_HALF_PAIRS_ROWS)
    if layout not in ("u4", "i8"):
        raise ValueError(f"no linear plan for layout {layout!r}")
    x_format = GEMV_X_FORMAT
    few = (LinearKernel.GROUP_PANELS if x_format == quantized_numba.X_INT16
           and quantized_panel_numba.GROUP_PANELS_RUN else LinearKernel.BLOCK_GEMV)
    return LinearPlan(few, MAX_QUANTIZED_GEMV_ROWS, LinearKernel.BLOCK_TILES, x_format)


def with_bf16_tiles(plan: LinearPlan) -> LinearPlan:
    """`plan` with its many-row float32 tiles of integer blocks in bfloat16 (a bfloat16 model
    on a CPU that multiplies bfloat16 natively: quantized_weights.pack_gguf_weights)."""
    if plan.many is not LinearKernel.BLOCK_TILES or plan.few not in (
            LinearKernel.BLOCK_GEMV, LinearKernel.GROUP_PANELS):
        return plan
    return replace(plan, many=LinearKernel.BLOCK_TILES_BF16)


def with_bf16_copy(plan: LinearPlan, panels_prefetch: bool = False) -> LinearPlan:
    """`plan` for a weight (integer blocks, or float16 the matrix units do not take) that also
    holds a bfloat16 copy of itself (quantized.PackedWeight.hold_bf16_copy): its few-row kernel
    up to MAX_BLOCK_ROWS_BESIDE_COPY rows (MAX_GROUP_PANEL_ROWS_BESIDE_COPY for group panels
    whose passes prefetch: `panels_prefetch`), the copy on the matrix units beyond."""
    if plan.many is LinearKernel.NATIVE_16BIT:
        raise ValueError("this weight's many rows run on the matrix units already: a bfloat16 "
                         "copy would add nothing")
    few_rows = (MAX_GROUP_PANEL_ROWS_BESIDE_COPY
                if plan.few is LinearKernel.GROUP_PANELS and panels_prefetch
                else MAX_BLOCK_ROWS_BESIDE_COPY)
    return LinearPlan(plan.few, few_rows, LinearKernel.NATIVE_16BIT, plan.x_format)


def with_int8_products(plan: LinearPlan) -> LinearPlan:
    """`plan` (`with_bf16_copy`'s, on integer blocks) for a weight that also holds an int8
    copy (quantized.PackedWeight.hold_int8_copy): its bfloat16 band ends below MIN_INT8_ROWS,
    the int8 products take every row count from there."""
    if plan.many is not LinearKernel.NATIVE_16BIT or plan.few not in (
            LinearKernel.BLOCK_GEMV, LinearKernel.GROUP_PANELS):
        raise ValueError("int8 products serve a weight of integer blocks beside its bfloat16 "
                         "copy")
    return replace(plan, many=LinearKernel.INT8_PRODUCTS, mid=LinearKernel.NATIVE_16BIT,
                   mid_rows=max(plan.few_rows, MIN_INT8_ROWS - 1))


def panels_plan(plan: LinearPlan) -> LinearPlan:
    """`plan` for the same weight held as its panels alone: the panel kernel at every row
    count a 16-bit weight's panels serve, the group panels for the few rows of integer blocks."""
    if plan.few in (LinearKernel.HALF_GEMV, LinearKernel.HALF_PANELS):
        return LinearPlan(LinearKernel.HALF_PANELS, max(plan.few_rows, MAX_QUANTIZED_GEMV_ROWS),
                          LinearKernel.HALF_PANELS)
    many = LinearKernel.GROUP_PANELS if plan.many is plan.few else plan.many
    return LinearPlan(LinearKernel.GROUP_PANELS, plan.few_rows, many, plan.x_format)
