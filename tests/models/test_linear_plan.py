"""linear_plan: the plan plan_for makes for each layout on each kind of CPU (what it reads
patched: the 16-bit panel kernel, the group panel kernel, the GEMV's x format, the native
flag), its row bands at their edges, on_panels / numba_rows, panels_plan, the x format and
MIN_NATIVE_HALF_ROWS it reads; and quantized_linear running exactly the kernel its weight's plan
names at each row count, for a weight of each layout on every plan plan_for can make for it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mrv2 import cpu_caps
from mrv2.models.layers import (cpu_linear, dense_gemv_numba, half_panel_linear, linear_plan,
                               quantized, quantized_numba, quantized_panel_numba,
                               quantized_tiles)
from mrv2.models.layers.linear_plan import LinearKernel as K
from mrv2.models.layers.linear_plan import LinearPlan, panels_plan, plan_for
from mrv2.models.layers.quantized import PackedWeight, quantized_linear

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw  # noqa: E402

F32, I8, I16 = quantized_numba.X_FLOAT32, quantized_numba.X_INT8, quantized_numba.X_INT16
MAX = linear_plan.MAX_QUANTIZED_GEMV_ROWS
PAIRS, PAIRS_MAX = linear_plan.MIN_HALF_PAIRS_ROWS, linear_plan.MAX_HALF_PAIRS_ROWS
LAYOUTS = ("u4", "i8", "f16", "bf16")
# CPU kind -> (16-bit panels run, group panels run, the GEMV's x format): AVX-512 (int16 x, the
# default where AVX2 compiles), AVX-512 with int8 x (opt-in) or float32 x, AVX2 alone, neither.
CPUS = {"avx512": (True, True, I16), "avx512_int8x": (True, True, I8),
        "avx512_float_x": (True, True, F32), "avx2": (False, False, I16),
        "generic": (False, False, F32)}


def _on_cpu(monkeypatch, cpu: str, min_native_rows: int = 8) -> None:
    panels, group_panels, x_format = CPUS[cpu]
    monkeypatch.setattr(half_panel_linear, "panels_run_here", lambda: panels)
    monkeypatch.setattr(quantized_panel_numba, "GROUP_PANELS_RUN", group_panels)
    monkeypatch.setattr(linear_plan, "GEMV_X_FORMAT", x_format)
    monkeypatch.setattr(linear_plan, "MIN_NATIVE_HALF_ROWS", min_native_rows)


def _expected(cpu: str, layout: str, native: bool, min_native_rows: int) -> LinearPlan:
    panels, group_panels, x_format = CPUS[cpu]
    if layout in ("f16", "bf16"):
        if native:
            return LinearPlan(K.HALF_GEMV, min(MAX, min_native_rows - 1), K.NATIVE_16BIT)
        if panels:
            return LinearPlan(K.HALF_PANELS, MAX, K.HALF_PANELS)
        return LinearPlan(K.HALF_GEMV, PAIRS - 1, K.BLOCK_TILES, mid=K.HALF_PAIRS,
                          mid_rows=PAIRS_MAX)
    few = K.GROUP_PANELS if group_panels and x_format == I16 else K.BLOCK_GEMV
    return LinearPlan(few, MAX, K.BLOCK_TILES, x_format)


@pytest.mark.parametrize("cpu", list(CPUS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("min_native_rows", [2, 8, 40])
def test_plan_for_each_layout_on_each_cpu(monkeypatch, cpu, layout, native, min_native_rows):
    _on_cpu(monkeypatch, cpu, min_native_rows)
    plan = plan_for(layout, native)
    assert plan == _expected(cpu, layout, native, min_native_rows)
    # Integer blocks take no native flag; 16-bit weights no x format.
    assert plan == plan_for(layout, not native) or layout in ("f16", "bf16")
    assert plan.x_format == F32 or layout in ("u4", "i8")


def test_plans_spelled_out(monkeypatch):
    """A few of the plans above as literals (not derived as `_expected` derives them)."""
    _on_cpu(monkeypatch, "avx512", min_native_rows=2)  # AMX or AVX-512 BF16
    assert plan_for("bf16", True) == LinearPlan(K.HALF_GEMV, 1, K.NATIVE_16BIT)
    assert plan_for("f16", False) == LinearPlan(K.HALF_PANELS, 32, K.HALF_PANELS)
    assert plan_for("u4", False) == LinearPlan(K.GROUP_PANELS, 32, K.BLOCK_TILES, I16)
    _on_cpu(monkeypatch, "avx2", min_native_rows=8)
    assert plan_for("i8", False) == LinearPlan(K.BLOCK_GEMV, 32, K.BLOCK_TILES, I16)
    assert plan_for("bf16", True) == LinearPlan(K.HALF_GEMV, 7, K.NATIVE_16BIT)
    assert plan_for("bf16", False) == LinearPlan(K.HALF_GEMV, 7, K.BLOCK_TILES,
                                                 mid=K.HALF_PAIRS, mid_rows=128)


def test_plan_for_refuses_other_layouts():
    with pytest.raises(ValueError, match="no linear plan for layout 'f32'"):
        plan_for("f32", False)


@pytest.mark.parametrize("plan", [LinearPlan(K.BLOCK_GEMV, 32, K.BLOCK_TILES, I8),
                                  LinearPlan(K.HALF_GEMV, 1, K.NATIVE_16BIT),
                                  LinearPlan(K.HALF_GEMV, 0, K.BLOCK_TILES)])
def test_kernel_for_turns_at_few_rows(plan):
    """`few` up to and at `few_rows` rows (none where it is 0: a test's way to force `many`),
    `many` from the next row on."""
    if plan.few_rows:
        assert plan.kernel_for(1) is plan.kernel_for(plan.few_rows) is plan.few
    assert plan.kernel_for(plan.few_rows + 1) is plan.kernel_for(10_000) is plan.many
    assert plan.pairs_from > 10_000


def test_a_middle_band_runs_between_few_and_many():
    plan = LinearPlan(K.HALF_GEMV, 7, K.BLOCK_TILES, mid=K.HALF_PAIRS, mid_rows=32)
    assert [plan.kernel_for(rows) for rows in (1, 7, 8, 32, 33)] == [
        K.HALF_GEMV, K.HALF_GEMV, K.HALF_PAIRS, K.HALF_PAIRS, K.BLOCK_TILES]
    assert plan.numba_rows == 32 and plan.pairs_from == 8  # the fused stack runs both bands
    # ... up to the GEMV's rows (MAX_QUANTIZED_GEMV_ROWS), where a band goes further.
    assert LinearPlan(K.HALF_GEMV, 7, K.BLOCK_TILES, mid=K.HALF_PAIRS,
                      mid_rows=128).numba_rows == MAX
    assert LinearPlan(K.HALF_GEMV, 7, K.BLOCK_TILES, mid=K.BLOCK_TILES,
                      mid_rows=32).numba_rows == 7


@pytest.mark.parametrize("few, on_panels, numba", [
    (K.HALF_GEMV, False, True), (K.HALF_PANELS, True, True), (K.BLOCK_GEMV, False, True),
    (K.GROUP_PANELS, True, True), (K.NATIVE_16BIT, False, False), (K.BLOCK_TILES, False, False)])
def test_on_panels_and_numba_rows(few, on_panels, numba):
    plan = LinearPlan(few, 7, K.BLOCK_TILES)
    assert plan.on_panels is on_panels
    assert plan.numba_rows == (7 if numba else 0)
    assert (few in linear_plan.NUMBA_KERNELS) is numba


@pytest.mark.parametrize("plan, expect", [
    (LinearPlan(K.HALF_GEMV, 1, K.NATIVE_16BIT), LinearPlan(K.HALF_PANELS, MAX, K.HALF_PANELS)),
    (LinearPlan(K.HALF_GEMV, MAX, K.BLOCK_TILES), LinearPlan(K.HALF_PANELS, MAX, K.HALF_PANELS)),
    (LinearPlan(K.HALF_GEMV, PAIRS - 1, K.BLOCK_TILES, mid=K.HALF_PAIRS, mid_rows=PAIRS_MAX),
     LinearPlan(K.HALF_PANELS, MAX, K.HALF_PANELS)),
    (LinearPlan(K.HALF_PANELS, MAX, K.HALF_PANELS), LinearPlan(K.HALF_PANELS, MAX, K.HALF_PANELS)),
    (LinearPlan(K.BLOCK_GEMV, MAX, K.BLOCK_TILES, I8),
     LinearPlan(K.GROUP_PANELS, MAX, K.BLOCK_TILES, I8)),
    (LinearPlan(K.GROUP_PANELS, MAX, K.BLOCK_TILES, I16),
     LinearPlan(K.GROUP_PANELS, MAX, K.BLOCK_TILES, I16))])
def test_panels_plan(plan, expect):
    assert panels_plan(plan) == expect
    assert panels_plan(expect) == expect and expect.on_panels


def _rows_beside_copy(plan: LinearPlan) -> int:
    """The rows a weight of `plan` keeps beside its bfloat16 copy, its panels (if any)
    prefetching: more for the group panels where the CPU has no matrix tiles."""
    if plan.few is K.GROUP_PANELS:
        return 4 if cpu_caps.caps().matrix_tiles else 8
    return 4


@pytest.mark.parametrize("plan", [LinearPlan(K.BLOCK_GEMV, MAX, K.BLOCK_TILES, I8),
                                  LinearPlan(K.GROUP_PANELS, MAX, K.BLOCK_TILES_BF16, I16)])
def test_a_bfloat16_copy_takes_the_rows_past_a_few(plan):
    """A weight beside its bfloat16 copy: its own kernel and x format up to
    MAX_BLOCK_ROWS_BESIDE_COPY rows (MAX_GROUP_PANEL_ROWS_BESIDE_COPY for group panels), the
    matrix units from the next row (`native_from`, where onednn_decode takes over from the
    fused stack, which runs the rows before)."""
    few = _rows_beside_copy(plan)
    copy = linear_plan.with_bf16_copy(plan, panels_prefetch=True)
    # Panels whose passes do not prefetch ("u6", "u4k") keep the copy from 5 rows.
    assert linear_plan.with_bf16_copy(plan).numba_rows == linear_plan.MAX_BLOCK_ROWS_BESIDE_COPY
    assert copy == LinearPlan(plan.few, few, K.NATIVE_16BIT, plan.x_format)
    assert copy.kernel_for(few) is plan.few and copy.kernel_for(few + 1) is K.NATIVE_16BIT
    assert copy.native_from == few + 1 and copy.numba_rows == few
    assert plan.native_from > 10_000  # no matrix units in a plan of blocks alone
    assert LinearPlan(K.HALF_GEMV, 1, K.NATIVE_16BIT).native_from == 2
    half = LinearPlan(K.HALF_PANELS, MAX, K.HALF_PANELS)  # float16 without matrix units
    assert linear_plan.with_bf16_copy(half) == LinearPlan(
        K.HALF_PANELS, linear_plan.MAX_BLOCK_ROWS_BESIDE_COPY, K.NATIVE_16BIT)
    with pytest.raises(ValueError, match="matrix units already"):
        linear_plan.with_bf16_copy(LinearPlan(K.HALF_GEMV, 1, K.NATIVE_16BIT))


@pytest.mark.parametrize("plan", [LinearPlan(K.BLOCK_GEMV, MAX, K.BLOCK_TILES, I8),
                                  LinearPlan(K.GROUP_PANELS, MAX, K.BLOCK_TILES_BF16, I16)])
def test_int8_products_take_a_prompts_rows_beside_the_bfloat16_copy(plan):
    """A weight of blocks beside its bfloat16 and int8 copies: the blocks up to
    MAX_BLOCK_ROWS_BESIDE_COPY rows, the bfloat16 copy up to MIN_INT8_ROWS - 1 (a decode step
    on onednn_decode: `native_from` unchanged), int8 products from MIN_INT8_ROWS on."""
    few, int8_from = _rows_beside_copy(plan), linear_plan.MIN_INT8_ROWS
    copies = linear_plan.with_int8_products(linear_plan.with_bf16_copy(plan, True))
    assert [copies.kernel_for(rows) for rows in (1, few, few + 1, int8_from - 1, int8_from,
                                                 4096)] == [
        plan.few, plan.few, K.NATIVE_16BIT, K.NATIVE_16BIT, K.INT8_PRODUCTS, K.INT8_PRODUCTS]
    assert copies.native_from == few + 1 and copies.numba_rows == few
    assert copies.x_format == plan.x_format
    for without_copy in (plan, LinearPlan(K.HALF_PANELS, 4, K.NATIVE_16BIT)):
        with pytest.raises(ValueError, match="integer blocks beside its bfloat16 copy"):
            linear_plan.with_int8_products(without_copy)


@pytest.mark.parametrize("int8_dots", [False, True])
@pytest.mark.parametrize("choice, want", [("", I16), ("float32", F32), ("int16", I16),
                                          ("int8", I8)])
def test_the_gemv_x_format(monkeypatch, int8_dots, choice, want):
    """int16 by default where numba compiles AVX2's integer multiply-adds, as
    MRV2_GGUF_ACTIVATIONS names otherwise; float32 without them, whatever it names."""
    monkeypatch.setattr(cpu_caps, "caps", lambda: cpu_caps.CpuCaps(gguf_activations=choice))
    monkeypatch.setattr(linear_plan, "X86_INT8_DOTS", int8_dots)
    assert linear_plan._gemv_x_format() == (want if int8_dots else F32)


def test_native_rows_from_two_only_where_a_few_row_kernel_reads_the_weights():
    """From 2 rows (not 8) only where a few-row kernel takes a bfloat16 model's linears: on
    oneDNN's calls alone the fused stack's GEMV was faster below 8 rows."""
    w = torch.randn(128, 64).bfloat16()
    has_kernel = (cpu_linear.available() and cpu_linear.computes_natively(torch.bfloat16)
                  and cpu_linear.few_rows_view(
        torch.ops.mkldnn._reorder_linear_weight(w)) is not None)
    assert (linear_plan.MIN_NATIVE_HALF_ROWS == 2) is has_kernel


# quantized_linear's kernels, each answering a constant of its own (so the output is shown to
# be that kernel's), and the x format the GEMV on blocks was given.
_MARKS = {kernel: float(i + 1) for i, kernel in enumerate(K)}


@pytest.fixture
def ran(monkeypatch) -> list:
    """Stand-ins for the seven kernels in the modules quantized_linear calls them from: each
    appends (its LinearKernel, rows[, x format]) and answers its mark."""
    calls: list = []

    def tensor_kernel(kernel):
        def run(x, *args, **kwargs):
            calls.append((kernel, len(x)))
            n = args[-1] if kernel is K.HALF_PANELS else (
                args[0].out_features if kernel is K.BLOCK_TILES else args[0].shape[0])
            return torch.full((len(x), n), _MARKS[kernel])
        return run

    def numba_kernel(kernel):
        def run(x, *args):
            calls.append((kernel, len(x)) + ((args[-2],) if kernel is K.BLOCK_GEMV else ()))
            args[-1][:] = _MARKS[kernel]
        return run

    monkeypatch.setattr(half_panel_linear, "half_panel_linear", tensor_kernel(K.HALF_PANELS))
    monkeypatch.setattr(cpu_linear, "native_16bit_linear", tensor_kernel(K.NATIVE_16BIT))
    monkeypatch.setattr(quantized_tiles, "tiled_linear", tensor_kernel(K.BLOCK_TILES))
    monkeypatch.setattr(dense_gemv_numba, "gemv_half", numba_kernel(K.HALF_GEMV))
    monkeypatch.setattr(dense_gemv_numba, "gemv_half_pairs", numba_kernel(K.HALF_PAIRS))
    monkeypatch.setattr(quantized_numba, "gemv_groups", numba_kernel(K.BLOCK_GEMV))
    monkeypatch.setattr(quantized_panel_numba, "group_panel_kernel",
                        numba_kernel(K.GROUP_PANELS))
    # oneDNN's packing is not what runs here (a CPU without oneDNN has none).
    monkeypatch.setattr(cpu_linear, "onednn_pack", lambda w: w)
    return calls


def _plans_of(monkeypatch, layout: str) -> list[LinearPlan]:
    """Every plan plan_for makes for `layout` on the CPUs above, and their panels' plans."""
    plans = []
    for cpu in CPUS:
        for native in (False, True):
            _on_cpu(monkeypatch, cpu)
            plans.append(plan_for(layout, native))
    plans += [panels_plan(plan) for plan in plans]
    return list(dict.fromkeys(plans))


@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "F16", "BF16"])
def test_quantized_linear_runs_the_kernel_its_plan_names(monkeypatch, ran, gguf_type):
    w = PackedWeight.from_gguf(random_raw(gguf_type, 70, 256, seed=1), gguf_type, (70, 256))
    plans = _plans_of(monkeypatch, w.layout)
    kernels = {kernel for plan in plans for kernel in (plan.few, plan.mid, plan.many)} - {None}
    assert kernels == ({K.HALF_GEMV, K.HALF_PAIRS, K.HALF_PANELS, K.NATIVE_16BIT, K.BLOCK_TILES}
                       if w.is_half else {K.BLOCK_GEMV, K.GROUP_PANELS, K.BLOCK_TILES})
    for plan in [w.plan, *plans]:
        monkeypatch.setattr(w, "plan", plan)
        for rows in sorted({1, plan.few_rows, plan.few_rows + 1, plan.mid_rows + 1, 40}):
            ran.clear()
            out = quantized_linear(torch.randn(rows, 256), w)
            kernel = plan.kernel_for(rows)
            assert ran == [(kernel, rows) + ((plan.x_format,) if kernel is K.BLOCK_GEMV
                                              else ())], (plan, rows)
            assert out.shape == (rows, 70) and bool((out == _MARKS[kernel]).all())


def test_a_weight_is_made_with_its_layouts_plan(monkeypatch):
    """PackedWeight's plan is plan_for's of its layout with the native flag of its dtype
    (quantized.computes_natively), made once: later patches leave it."""
    _on_cpu(monkeypatch, "avx512")
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: dtype == torch.bfloat16)
    for gguf_type in ("Q4_1", "Q8_0", "F16", "BF16"):
        w = PackedWeight.from_gguf(random_raw(gguf_type, 8, 256, seed=0), gguf_type, (8, 256))
        assert w.plan == plan_for(w.layout, gguf_type == "BF16")
        made = w.plan
        monkeypatch.setattr(linear_plan, "GEMV_X_FORMAT", I8)
        assert w.plan is made
        monkeypatch.setattr(linear_plan, "GEMV_X_FORMAT", I16)
