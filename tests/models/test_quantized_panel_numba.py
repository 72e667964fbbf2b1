"""The int16-activation panel kernel on GGUF blocks (quantized_panel_numba): the kernel against
the exact sum of its quantized operands (and the int16 GEMV on the rows) for every panel form
("i8" signed blocks with and without min terms, "u4", "u6"), 32- and 16-input groups, float16
and float32 tables, outputs past whole panels and rows past whole passes; the float32 rows and
transposed tiles of the panels against the blocks' dequantization; quantized_linear's and the
decode stack's routing. The panels' bytes: test_quantized_panel_layout.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mrv2.models.layers import linear_plan, quantized_int8_numba, quantized_numba
from mrv2.models.layers import quantized_panel_layout as layout
from mrv2.models.layers import quantized_panel_numba as panel
from mrv2.models.layers.gguf_blocks import as_byte_groups, unpack_u4
from mrv2.models.layers.linear_plan import LinearKernel
from mrv2.models.layers.quantized import PackedWeight, quantized_linear

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw  # noqa: E402

needs_panels = pytest.mark.skipif(not panel.GROUP_PANELS_RUN,
                                  reason="needs a host with AVX-512 BW")
# 32-input groups: "i8" without a min (Q8_0, Q5_0), with one (Q5_1), float32 tables (Q5_K);
# "u4" nibbles without a min table (Q4_0: q - 8), with one (Q4_1), float32 tables ("Q4_K/u4": a
# Q4_K whose scales do not factor), "u4k" (Q4_K: sub-scales and sub-mins). 16-input groups:
# "u6" (Q6_K), "i8" without a min ("Q6_K/i8": a Q6_K whose scales do not factor) and with one
# ("Q4_K/16": Q4_K as bytes in 16-input groups, as a fused projection mixing it with Q6_K
# holds it).
BLOCK_TYPES = ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q4_0", "Q4_1", "Q4_K", "Q4_K/u4", "Q6_K",
               "Q6_K/i8", "Q4_K/16"]
_FORM_BYTES = {"Q4_0": 64, "Q4_1": 64, "Q4_K/u4": 64, "Q4_K": layout.U4K_PAIR_BYTES,
               "Q6_K": layout.U6_PAIR_BYTES}  # else 128


def _weight(gguf_type: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    if gguf_type == "Q4_K/16":
        w = _weight("Q4_K", n, k, seed)
        tables = as_byte_groups(w.q.numpy(), w.scales.numpy(), w.mins.numpy(), True, 16)
        return PackedWeight("i8", 16, *(torch.from_numpy(t) for t in tables), "Q4_K")
    if gguf_type in ("Q6_K/i8", "Q4_K/u4"):
        w = _weight(gguf_type[:4], n, k, seed)
        scales = w.scales.clone()
        scales[0, 0] = 1 / 3  # 24 significant bits: no float x int8 sub-scale makes it
        return PackedWeight(w.layout, w.group_size, w.q, scales, w.mins, gguf_type[:4])
    return PackedWeight.from_gguf(random_raw(gguf_type, n, k, seed), gguf_type, (n, k))


def _exact(x: np.ndarray, w: PackedWeight) -> tuple[np.ndarray, np.ndarray]:
    """x's int16 format against w in float64: the sum the kernel rounds, and the sum of its
    terms' magnitudes (for the float32 order bound). A "u4" weight whose panels have no min
    table (Q4_0) is summed as q - 8 against x's int16 values, no float min term."""
    xq = np.empty(x.shape, np.int16)
    dx = np.empty((x.shape[0], x.shape[1] // 32), np.float32)
    quantized_int8_numba.quantize_rows(x, xq, dx)
    groups, size = w.scales.shape[1], w.group_size  # a 16-input group: its 32-block's d
    q = (w.q.numpy() if w.layout == "i8" else unpack_u4(w.q.numpy())).astype(np.float64)
    offset = w.layout == "u4" and w.group_panels()[2].shape[1] == 0
    q = (q - 8 if offset else q).reshape(w.out_features, groups, size)
    xg = xq.astype(np.float64).reshape(len(x), groups, size)
    isum = np.einsum("ngk,mgk->mng", q, xg)
    tables = w._with_float32_tables()  # float16-bit tables widened as the kernels do
    terms = isum * tables.scales.numpy()[None] * np.repeat(dx, 32 // size, axis=1)[:, None, :]
    mins = None if tables.mins is None or offset else tables.mins.numpy()
    if mins is not None:
        xsum = x.astype(np.float64).reshape(len(x), groups, size).sum(-1)
        terms = np.concatenate([terms, mins[None] * xsum[:, None, :]], axis=-1)
    return terms.sum(-1), np.abs(terms).sum(-1)


# (n, k, rows): one whole panel and pass, outputs past whole panels, rows past whole passes;
# K-quants take K in 256-input super-blocks.
_SHAPES = [(64, 32, 1), (70, 96, 3), (130, 256, 5), (40, 288, 9)]
_CASES = [(t, *shape) for t in BLOCK_TYPES for shape in _SHAPES
          if not ("_K" in t and shape[1] % 256)] + [(t, 70, 512, 6) for t in
                                                     ("Q5_K", "Q4_K", "Q4_K/u4", "Q6_K",
                                                      "Q6_K/i8", "Q4_K/16")]


@needs_panels
@pytest.mark.parametrize("gguf_type, n, k, rows", _CASES)
def test_kernel_is_the_exact_sum_up_to_float32_order(gguf_type, n, k, rows):
    w = _weight(gguf_type, n, k, seed=n + k)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero group: d = 0
    out = np.empty((rows, n), np.float32)
    panel.group_panel_kernel(x, *w.group_panels(), w.layout == "u4", out)
    exact, magnitude = _exact(x, w)
    bound = (2 * k // w.group_size + 2) * 2.0 ** -24 * magnitude
    assert np.all(np.abs(out - exact) <= bound)
    if gguf_type == "Q4_0":  # the GEMV sums x's float values against Q4_0's offset
        assert w.group_panels()[2].shape[1] == 0
        return
    # The GEMV on the rows sums the same integers in another float order.
    gemv = np.empty_like(out)
    quantized_numba.gemv_groups(x, w.q.view(torch.uint8).numpy(), w.scales.numpy(),
                                w.kernel_mins.numpy(), w.layout == "u4", w.group_size,
                                quantized_numba.X_INT16, gemv)
    assert np.all(np.abs(out - gemv) <= 2 * bound)


@needs_panels
@pytest.mark.parametrize("rows", [1, 5])
def test_u6_panels_give_the_i8_forms_sums(rows, monkeypatch):
    """A Q6_K weight's "u6" panels (sub x super-scale) and its "i8" ones (the float scales):
    the same integer sums times the same scales, the outputs apart only by float order."""
    w = _weight("Q6_K", 130, 512, seed=4)
    u6 = w.group_panels()
    monkeypatch.setattr(layout, "_super_scales", lambda table, per_super: None)
    i8 = layout.group_panels_of(w.q.numpy(), w.scales.numpy(), None)
    assert u6[0].shape[2] == layout.U6_PAIR_BYTES and i8[0].shape[2] == 128
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    out_u6, out_i8 = np.empty((rows, 130), np.float32), np.empty((rows, 130), np.float32)
    panel.group_panel_kernel(x, *u6, False, out_u6)
    panel.group_panel_kernel(x, *i8, False, out_i8)
    _, magnitude = _exact(x, w)
    assert np.all(np.abs(out_u6 - out_i8) <= 2 * (2 * 512 // 16 + 2) * 2.0 ** -24 * magnitude)


@pytest.mark.parametrize("gguf_type, takes", [("Q8_0", True), ("Q5_1", True), ("Q4_1", True),
                                              ("Q6_K", True), ("Q4_K/16", True), ("F16", False)])
def test_plans_take_group_panels_only_for_integer_blocks_with_int16_x(gguf_type, takes,
                                                                      monkeypatch):
    def made_with(x_format: int, runs: bool) -> PackedWeight:
        monkeypatch.setattr(linear_plan, "GEMV_X_FORMAT", x_format)
        monkeypatch.setattr(panel, "GROUP_PANELS_RUN", runs)
        return _weight(gguf_type, 16, 256)

    group = LinearKernel.GROUP_PANELS
    assert (made_with(quantized_numba.X_INT16, True).plan.few is group) == takes
    assert made_with(quantized_numba.X_INT8, True).plan.few is not group
    assert made_with(quantized_numba.X_INT16, False).plan.few is not group
    if takes:  # a weight held as its panels has no other form to compute on
        w = made_with(quantized_numba.X_INT8, True)
        assert w.plan.few is LinearKernel.BLOCK_GEMV and not w.plan.on_panels
        w.store_as_panels()
        assert w.plan.few is group and w.plan.on_panels


@needs_panels
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_quantized_linear_runs_the_panels_and_makes_them_once(rows, monkeypatch):
    monkeypatch.setattr(linear_plan, "GEMV_X_FORMAT", quantized_numba.X_INT16)
    w = _weight("Q8_0", 100, 128, seed=3)
    assert w.plan.kernel_for(rows) is LinearKernel.GROUP_PANELS
    x = torch.randn(rows, 128)
    got = quantized_linear(x, w)
    panels = w.group_panels()
    assert w.group_panels() is panels
    direct = np.empty((rows, 100), np.float32)
    panel.group_panel_kernel(x.numpy(), *panels, False, direct)
    assert np.array_equal(got.numpy(), direct)
