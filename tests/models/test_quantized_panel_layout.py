"""The panels' bytes (quantized_panel_layout): "i8" pairs, "u4" octets and "u6" strings of
each output's inputs with their tables, zeros past N, which form a weight's values and tables
get (a Q6_K's scales factor into int8 sub-scales x a float per 256 inputs, bit for bit; Q4_0's
mins are dropped); the float32 rows and transposed tiles read back from every form against the
blocks' dequantization."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from mrv2.models.layers import quantized_panel_layout as layout
from mrv2.models.layers.gguf_blocks import pack_u4, unpack_u4
from mrv2.models.layers.quantized import PackedWeight

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw  # noqa: E402
from test_quantized_panel_numba import _FORM_BYTES, BLOCK_TYPES, _weight  # noqa: E402
from tests.models.quantized_helpers import dequantized  # noqa: E402

def test_panels_hold_each_outputs_input_pairs_and_zeros_past_n():
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, size=(70, 64), dtype=np.int8)
    scales = rng.random((70, 2), dtype=np.float32)
    weights, scale_panels, min_panels = layout.group_panels_of(q, scales, None)
    assert weights.shape == (2, 32, 128) and scale_panels.shape == (2, 2, 64)
    assert min_panels.shape == (2, 0, 64)
    for row, p, t in ((0, 0, 0), (5, 3, 1), (63, 31, 1), (64, 7, 0), (69, 31, 1)):
        assert weights[row // 64, p, 2 * (row % 64) + t] == q[row, 2 * p + t]
        assert scale_panels[row // 64, p % 2, row % 64] == scales[row, p % 2]
    assert not weights[1, :, 2 * 6:].any() and not scale_panels[1, :, 6:].any()
    with pytest.raises(ValueError, match="groups of 32"):
        layout.group_panels_of(q[:, :48], scales, None)
    # Bytes in 16-input groups: a table entry per 8 pairs.
    _, scale_panels, _ = layout.group_panels_of(q, np.repeat(scales, 2, axis=1), None)
    assert scale_panels.shape == (2, 4, 64) and scale_panels[1, 3, 5] == scales[69, 1]
    # "u4": octets of inputs; 64 bytes (row 4 c + j of a panel) hold outputs 16 j .. 16 j + 15
    # of octet c, as 16-bit words: word 2 o + t has input 8 c + 2 k + t in nibble k.
    values = rng.integers(0, 16, size=(70, 64), dtype=np.uint8)
    nibbles, _, _ = layout.group_panels_of(pack_u4(values), scales, scales, packed=True)
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
        sixteens = np.repeat(scales, 2, axis=1)
        layout.group_panels_of(pack_u4(values), sixteens, sixteens, packed=True)
    # Float16 bit-pattern tables stay float16 in the panels; the two tables share one dtype.
    bits = rng.random((70, 2), dtype=np.float32).astype(np.float16).view(np.int16)
    _, scale_panels, min_panels = layout.group_panels_of(q, bits, bits)
    assert scale_panels.dtype == min_panels.dtype == np.int16
    assert scale_panels[1, 1, 5] == bits[69, 1] and not min_panels[1, :, 6:].any()
    with pytest.raises(ValueError, match="one dtype"):
        layout.group_panels_of(q, bits, scales)


@pytest.mark.parametrize("gguf_type", BLOCK_TYPES)
def test_rows_and_tiles_of_the_panels_are_the_dequantized_weight(gguf_type):
    n, k = 150, 512  # two whole panels and a ragged third
    w = _weight(gguf_type, n, k, seed=11)
    exact = dequantized(w).numpy()
    panels, packed = w.group_panels(), w.layout == "u4"
    assert panels[0].shape[2] == _FORM_BYTES.get(gguf_type, 128)
    ids = np.array([149, 0, 64, 63, 128], np.int64)
    rows = np.empty((len(ids), k), np.float32)
    layout.panel_rows(*panels, packed, ids, rows)
    assert np.array_equal(rows, exact[ids])
    tile = np.full((k, 3 * 64 + 5), np.nan, np.float32)
    layout.panel_tile_t(*panels, packed, 1, 2, tile)  # panels 1 and 2: outputs 64 .. 191
    assert np.array_equal(tile[:, :n - 64], exact[64:].T)
    assert not tile[:, n - 64:128].any() and np.isnan(tile[:, 128:]).all()


def _u6_value(weights: np.ndarray, row: int, col: int) -> int:
    """Input `col` of output `row` from "u6" panels: word 2 o + t of rows 4 r + j of its group
    (832 bytes), the three a 48-bit string with input 2 m + t at bits 6 m, two's complement."""
    group = weights[row // 64].reshape(-1, 832)[col // 16]
    j, o, m, t = row % 64 // 16, row % 16, col % 16 // 2, col % 2
    pieces = [int(group[64 * (4 * r + j) + 4 * o + 2 * t:][:2].view(np.uint16)[0])
              for r in range(3)]
    field = ((pieces[0] | pieces[1] << 16 | pieces[2] << 32) >> 6 * m) & 63
    return field - 64 if field >= 32 else field


def test_q6_k_panels_are_u6_strings_with_sub_scales_of_a_super_scale():
    n, k = 70, 512
    w = PackedWeight.from_gguf(random_raw("Q6_K", n, k, 3), "Q6_K", (n, k))
    q, scales = w.q.numpy(), w.scales.numpy()
    weights, supers, mins = layout.group_panels_of(q, scales, None)
    assert weights.shape == (2, k // 2, layout.U6_PAIR_BYTES) and weights.dtype == np.int8
    assert supers.shape == (2, k // 256, 64) and mins.shape == (2, 0, 64)
    for row, col in ((0, 0), (5, 3), (17, 14), (63, 255), (64, 256), (69, 511), (33, 37)):
        assert _u6_value(weights, row, col) == q[row, col]
    # Sub-scale (bytes 768 + o of a group) x super-scale: the scale, bit for bit.
    subs = weights.reshape(2, k // 16, 832)[:, :, 768:].astype(np.float32)  # [B, group, o]
    products = subs * np.repeat(supers, 16, axis=1)
    assert np.array_equal(products.transpose(0, 2, 1).reshape(128, -1)[:n], scales)
    assert not weights[1].reshape(-1, 832)[:, 768 + 6:].any()  # outputs 70..: zeros
    assert not supers[1, :, 6:].any()


def test_super_scales_factor_exactly_or_not_at_all():
    rng = np.random.default_rng(1)
    values = rng.integers(-32, 32, size=(3, 256), dtype=np.int8)
    d = np.float16([0.0123, -0.0456, 0.0]).astype(np.float32)
    subs = rng.integers(-128, 128, size=(3, 16)).astype(np.float32)
    subs[0, 5], subs[1, 2] = -128, -128  # under a negative d, +128 x |d|
    scales = (d[:, None] * subs).astype(np.float32)
    supers, found = layout._super_scales(scales, 16)
    assert np.array_equal(found.astype(np.float32) * np.repeat(supers, 16, axis=1), scales)
    assert found.dtype == np.int8 and supers[2, 0] == 0
    assert layout.group_panels_of(values, scales, None)[0].shape[2] == layout.U6_PAIR_BYTES
    # Scales of no float x int8 form, non-finite scales: none; values past 6 bits: "i8".
    thirds = scales.copy()
    thirds[0, 0] = 1 / 3
    assert layout._super_scales(thirds, 16) is None
    thirds[0, 0] = np.nan
    assert layout._super_scales(thirds, 16) is None
    weights, _, _ = layout.group_panels_of(values, thirds, None)
    assert weights.shape[2] == 2 * layout.GROUP_PANEL_OUTPUTS  # "i8", as before
    weights, _, _ = layout.group_panels_of(np.full((3, 256), 40, np.int8), scales, None)
    assert weights.shape[2] == 2 * layout.GROUP_PANEL_OUTPUTS
    # 32-input groups (a 16-group "u6" would misread them), however they factor: "i8".
    weights, _, _ = layout.group_panels_of(np.zeros((3, 512), np.int8), scales, None)
    assert weights.shape[2] == 2 * layout.GROUP_PANEL_OUTPUTS


@pytest.mark.parametrize("gguf_type, width", [("Q8_0", 128), ("Q5_K", 128), ("Q4_1", 64),
                                               ("Q4_K", layout.U4K_PAIR_BYTES)])
def test_each_type_s_form(gguf_type, width):
    w = PackedWeight.from_gguf(random_raw(gguf_type, 64, 256, 0), gguf_type, (64, 256))
    weights, _, _ = layout.group_panels_of(
        w.q.numpy(), w.scales.numpy(), None if w.mins is None else w.mins.numpy(),
        packed=w.layout == "u4")
    assert weights.shape[2] == width


def test_q4_k_panels_are_octets_with_sub_scales_and_sub_mins():
    n, k = 70, 512
    w = PackedWeight.from_gguf(random_raw("Q4_K", n, k, 5), "Q4_K", (n, k))
    values = unpack_u4(w.q.numpy())
    weights, supers, min_supers = layout.group_panels_of(
        w.q.numpy(), w.scales.numpy(), w.mins.numpy(), packed=True)
    assert weights.shape == (2, k // 2, layout.U4K_PAIR_BYTES)
    assert supers.shape == min_supers.shape == (2, k // 256, 64)
    groups = weights.reshape(2, k // 32, 1152)
    for row, col in ((0, 0), (5, 3), (17, 14), (63, 255), (64, 256), (69, 511), (33, 37)):
        j, o, c, i = row % 64 // 16, row % 16, col % 32 // 8, col % 8
        word = groups[row // 64, col // 32, 256 * c + 64 * j + 4 * o + 2 * (i % 2):][:2]
        assert (int(word.view(np.uint16)[0]) >> 4 * (i // 2)) & 15 == values[row, col]
    for at, table, sup in ((1024, w.scales.numpy(), supers), (1088, w.mins.numpy(), min_supers)):
        subs = groups[:, :, at:at + 64].astype(np.float32)  # [B, group, o]
        products = subs * np.repeat(sup, 8, axis=1)
        assert np.array_equal(products.transpose(0, 2, 1).reshape(128, -1)[:n], table)


def test_q4_0_panels_have_no_min_table():
    """Q4_0's mins are -8 x its scales: its "u4" panels drop them (the kernels take q - 8);
    Q4_1's and Q4_K's keep theirs."""
    for gguf_type, has_mins in (("Q4_0", False), ("Q4_1", True)):
        w = PackedWeight.from_gguf(random_raw(gguf_type, 64, 256, 0), gguf_type, (64, 256))
        weights, scales, mins = layout.group_panels_of(
            w.q.numpy(), w.scales.numpy(), w.mins.numpy(), packed=True)
        assert weights.shape[2] == 64 and (mins.shape[1] > 0) == has_mins
        assert mins.shape[1] in (0, scales.shape[1])
    with pytest.raises(ValueError, match="unsigned"):
        layout.group_panels_of(w.q.numpy(), w.scales.numpy(), None, packed=True)
