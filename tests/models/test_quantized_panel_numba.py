"""The int16-activation panel kernel on GGUF blocks (quantized_panel_numba): the panel layout
(float16 or float32 tables), the kernel against the exact sum of its quantized operands (and the
int16 GEMV on the rows) for signed blocks with and without min terms, 32- and 16-input groups,
float16 and float32 tables, outputs past whole panels and rows past whole passes; the float32
rows and transposed tiles of the panels against the blocks' dequantization; quantized_linear's
and the decode stack's routing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mrv2.models.layers import quantized, quantized_int8_numba, quantized_numba
from mrv2.models.layers import quantized_panel_numba as panel
from mrv2.models.layers.gguf_blocks import as_byte_groups, pack_u4, unpack_u4
from mrv2.models.layers.quantized import QuantizedWeight, quantized_linear

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw  # noqa: E402

needs_panels = pytest.mark.skipif(not panel.GROUP_PANELS_RUN,
                                  reason="needs a host with AVX-512 BW")
# 32-input groups: "i8" without a min (Q8_0, Q5_0), with one (Q5_1), float32 tables (Q5_K);
# "u4" nibbles with Q4_0's offset as a min, Q4_1's min, float32 tables (Q4_K). 16-input groups:
# "i8" without a min (Q6_K), and with one ("Q4_K/16": Q4_K as bytes in 16-input groups, as a
# fused projection mixing it with Q6_K holds it).
BLOCK_TYPES = ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K/16"]


def _weight(gguf_type: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    if gguf_type == "Q4_K/16":
        w = _weight("Q4_K", n, k, seed)
        tables = as_byte_groups(w.q.numpy(), w.scales.numpy(), w.mins.numpy(), True, 16)
        return QuantizedWeight("i8", 16, *(torch.from_numpy(t) for t in tables), "Q4_K")
    return QuantizedWeight.from_gguf(random_raw(gguf_type, n, k, seed), gguf_type, (n, k))


def test_panels_hold_each_outputs_input_pairs_and_zeros_past_n():
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, size=(70, 64), dtype=np.int8)
    scales = rng.random((70, 2), dtype=np.float32)
    weights, scale_panels, min_panels = panel.group_panels_of(q, scales, None)
    assert weights.shape == (2, 32, 128) and scale_panels.shape == (2, 2, 64)
    assert min_panels.shape == (2, 0, 64)
    for row, p, t in ((0, 0, 0), (5, 3, 1), (63, 31, 1), (64, 7, 0), (69, 31, 1)):
        assert weights[row // 64, p, 2 * (row % 64) + t] == q[row, 2 * p + t]
        assert scale_panels[row // 64, p % 2, row % 64] == scales[row, p % 2]
    assert not weights[1, :, 2 * 6:].any() and not scale_panels[1, :, 6:].any()
    with pytest.raises(ValueError, match="groups of 32"):
        panel.group_panels_of(q[:, :48], scales, None)
    # Bytes in 16-input groups: a table entry per 8 pairs.
    _, scale_panels, _ = panel.group_panels_of(q, np.repeat(scales, 2, axis=1), None)
    assert scale_panels.shape == (2, 4, 64) and scale_panels[1, 3, 5] == scales[69, 1]
    # "u4": octets of inputs; 64 bytes (row 4 c + j of a panel) hold outputs 16 j .. 16 j + 15
    # of octet c, as 16-bit words: word 2 o + t has input 8 c + 2 k + t in nibble k.
    values = rng.integers(0, 16, size=(70, 64), dtype=np.uint8)
    nibbles, _, _ = panel.group_panels_of(pack_u4(values), scales, None, packed=True)
    assert nibbles.shape == (2, 32, 64)
    for row, c in ((0, 0), (5, 3), (17, 1), (63, 7), (64, 2), (69, 5)):
        j, o = row % 64 // 16, row % 16
        for t in range(2):
            word = nibbles[row // 64, 4 * c + j, 4 * o + 2 * t:4 * o + 2 * t + 2].view(np.uint16)
            assert [(int(word[0]) >> 4 * k) & 15 for k in range(4)] == [
                values[row, 8 * c + 2 * k + t] for k in range(4)]
    past_n = nibbles[1].reshape(8, 4, 64)  # outputs 70.. of the second panel: zeros
    assert not past_n[:, 0, 4 * 6:].any() and not past_n[:, 1:].any() and past_n[:, 0].any()
    with pytest.raises(ValueError, match="not nibbles"):
        panel.group_panels_of(pack_u4(values), np.repeat(scales, 2, axis=1), None, packed=True)
    # Float16 bit-pattern tables stay float16 in the panels; the two tables share one dtype.
    bits = rng.random((70, 2), dtype=np.float32).astype(np.float16).view(np.int16)
    _, scale_panels, min_panels = panel.group_panels_of(q, bits, bits)
    assert scale_panels.dtype == min_panels.dtype == np.int16
    assert scale_panels[1, 1, 5] == bits[69, 1] and not min_panels[1, :, 6:].any()
    with pytest.raises(ValueError, match="one dtype"):
        panel.group_panels_of(q, bits, scales)


@pytest.mark.parametrize("gguf_type", BLOCK_TYPES)
def test_rows_and_tiles_of_the_panels_are_the_dequantized_weight(gguf_type):
    n, k = 150, 512  # two whole panels and a ragged third
    w = _weight(gguf_type, n, k, seed=11)
    exact = w.dequantize().numpy()
    panels, packed = w.group_panels(), w.layout == "u4"
    ids = np.array([149, 0, 64, 63, 128], np.int64)
    rows = np.empty((len(ids), k), np.float32)
    panel.panel_rows(*panels, packed, ids, rows)
    assert np.array_equal(rows, exact[ids])
    tile = np.full((k, 3 * 64 + 5), np.nan, np.float32)
    panel.panel_tile_t(*panels, packed, 1, 2, tile)  # panels 1 and 2: outputs 64 .. 191
    assert np.array_equal(tile[:, :n - 64], exact[64:].T)
    assert not tile[:, n - 64:128].any() and np.isnan(tile[:, 128:]).all()


def _exact(x: np.ndarray, w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """x's int16 format against w in float64: the sum the kernel rounds, and the sum of its
    terms' magnitudes (for the float32 order bound)."""
    xq = np.empty(x.shape, np.int16)
    dx = np.empty((x.shape[0], x.shape[1] // 32), np.float32)
    quantized_int8_numba.quantize_rows(x, xq, dx)
    groups, size = w.scales.shape[1], w.group_size  # a 16-input group: its 32-block's d
    q = (w.q.numpy() if w.layout == "i8" else unpack_u4(w.q.numpy())).astype(np.float64)
    q = q.reshape(w.out_features, groups, size)
    xg = xq.astype(np.float64).reshape(len(x), groups, size)
    isum = np.einsum("ngk,mgk->mng", q, xg)
    tables = w._with_float32_tables()  # float16-bit tables widened as the kernels do
    terms = isum * tables.scales.numpy()[None] * np.repeat(dx, 32 // size, axis=1)[:, None, :]
    mins = None if tables.mins is None else tables.mins.numpy()
    if mins is not None:
        xsum = x.astype(np.float64).reshape(len(x), groups, size).sum(-1)
        terms = np.concatenate([terms, mins[None] * xsum[:, None, :]], axis=-1)
    return terms.sum(-1), np.abs(terms).sum(-1)


# (n, k, rows): one whole panel and pass, outputs past whole panels, rows past whole passes;
# K-quants take K in 256-input super-blocks.
_SHAPES = [(64, 32, 1), (70, 96, 3), (130, 256, 5), (40, 288, 9)]
_CASES = [(t, *shape) for t in BLOCK_TYPES for shape in _SHAPES
          if not ("_K" in t and shape[1] % 256)] + [(t, 70, 512, 6) for t in
                                                     ("Q5_K", "Q4_K", "Q6_K", "Q4_K/16")]


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
    # The GEMV on the rows sums the same integers in another float order.
    gemv = np.empty_like(out)
    quantized_numba.gemv_groups(x, w.q.view(torch.uint8).numpy(), w.scales.numpy(),
                                w.kernel_mins.numpy(), w.layout == "u4", w.group_size,
                                quantized_numba.X_INT16, gemv)
    assert np.all(np.abs(out - gemv) <= 2 * bound)


@pytest.mark.parametrize("gguf_type, takes", [("Q8_0", True), ("Q5_1", True), ("Q4_1", True),
                                              ("Q6_K", True), ("Q4_K/16", True), ("F16", False)])
def test_takes_group_panels_only_integer_blocks_with_int16_x(gguf_type, takes, monkeypatch):
    w = _weight(gguf_type, 16, 256)
    monkeypatch.setattr(panel, "GROUP_PANELS_RUN", True)
    monkeypatch.setattr(quantized, "GEMV_X_FORMAT", quantized_numba.X_INT16)
    assert quantized.takes_group_panels(w) == takes
    monkeypatch.setattr(quantized, "GEMV_X_FORMAT", quantized_numba.X_INT8)
    assert not quantized.takes_group_panels(w)
    monkeypatch.setattr(quantized, "GEMV_X_FORMAT", quantized_numba.X_INT16)
    monkeypatch.setattr(panel, "GROUP_PANELS_RUN", False)
    assert not quantized.takes_group_panels(w)
    if takes:  # a weight held as its panels has no other form to compute on
        monkeypatch.setattr(panel, "GROUP_PANELS_RUN", True)
        w.store_as_panels()
        monkeypatch.setattr(quantized, "GEMV_X_FORMAT", quantized_numba.X_INT8)
        assert quantized.takes_group_panels(w)


@needs_panels
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_quantized_linear_runs_the_panels_and_makes_them_once(rows, monkeypatch):
    monkeypatch.setattr(quantized, "GEMV_X_FORMAT", quantized_numba.X_INT16)
    w = _weight("Q8_0", 100, 128, seed=3)
    x = torch.randn(rows, 128)
    got = quantized_linear(x, w)
    panels = w.group_panels()
    assert w.group_panels() is panels
    direct = np.empty((rows, 100), np.float32)
    panel.group_panel_kernel(x.numpy(), *panels, False, direct)
    assert np.array_equal(got.numpy(), direct)
