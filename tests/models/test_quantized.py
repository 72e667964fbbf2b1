"""Quantized GGUF weights: repacking against gguf.quants.dequantize, the GEMV (float activations)
and tiled paths against x @ dequantize().T, rows/cat, and the errors. The int8-activation GEMV:
test_quantized_int8_numba.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from mrv2.models.layers import (cpu_linear, half_panel_linear, int8_linear, linear_plan,
                                quantized, quantized_panel_numba, quantized_tiles)
from mrv2.models.layers.linear_plan import LinearKernel
from mrv2.models.layers.quant_formats import FORMATS
from mrv2.models.layers.quantized import PackedWeight, quantized_linear
from tests.models.quantized_helpers import dequantized
from tests.models.linear_plan_helpers import replan, set_plan

# Byte offsets of each type's f16 fields inside a block (ggml's block layouts; gguf-py quants.py).
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
HALF_TYPES = ("F16", "BF16")
TYPES = sorted(FORMATS)


def random_raw(gguf_type: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random valid blocks: random bytes with the f16 fields set to finite values in +-0.05
    (16-bit types: every value, bfloat16 as float32's high half)."""
    qtype = gguf.GGMLQuantizationType[gguf_type]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if gguf_type in HALF_TYPES:
        values = rng.uniform(-0.05, 0.05, size=(n, k)).astype(np.float32)
        bits = (values.astype(np.float16).view(np.uint16) if gguf_type == "F16"
                else (values.view(np.uint32) >> 16).astype(np.uint16))
        return bits.view(np.uint8).reshape(n, -1)
    blocks = rng.integers(0, 256, size=(n * k // block_size, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS.get(gguf_type, ()):
        f = rng.uniform(-0.05, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = f.view(np.uint8).reshape(-1, 2)
    if gguf_type == "MXFP4":  # the e8m0 byte: scales 2^-18 .. 2^2 (finite, float16-exact)
        blocks[:, 0] = rng.integers(110, 131, size=blocks.shape[0])
    return blocks.reshape(n, -1)


def reference(raw: np.ndarray, gguf_type: str, n: int, k: int) -> torch.Tensor:
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[gguf_type])
    return torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32).reshape(n, k))


@pytest.fixture(scope="module")
def weights() -> dict[str, tuple[PackedWeight, torch.Tensor]]:
    """Per type: a [96, 1536] weight (K = 6 super-blocks, not a power of two) and its reference."""
    out = {}
    for i, t in enumerate(TYPES):
        raw = random_raw(t, 96, 1536, seed=i)
        out[t] = (PackedWeight.from_gguf(raw, t, (96, 1536)), reference(raw, t, 96, 1536))
    return out


@pytest.fixture
def float_weights(weights, float_activations, monkeypatch):
    """`weights` on the plans weights made under float_activations get (theirs were made
    before it applied): float32 x, no matrix units."""
    for w, _ in weights.values():
        replan(monkeypatch, w)
    return weights


@pytest.mark.parametrize("gguf_type", TYPES)
@pytest.mark.parametrize("n, k", [(3, 256), (40, 576), (96, 1536)])
def test_dequantize_is_bit_exact(gguf_type, n, k):
    # Bound: exact. scale * q is exact in float32 (an f16 times integers of <= 14 bits in all),
    # so w = scale * q + min rounds once, on the add, as the reference's d * q - dm does.
    if k % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]][0]:
        pytest.skip("K is not a whole number of this type's blocks")
    raw = random_raw(gguf_type, n, k, seed=n + k)
    w = PackedWeight.from_gguf(raw, gguf_type, (n, k))
    assert (w.out_features, w.in_features, w.gguf_type) == (n, k, gguf_type)
    ref = reference(raw, gguf_type, n, k)
    assert torch.equal(dequantized(w), ref)
    ids = torch.tensor([n - 1, 0, n // 2, 0])
    assert torch.equal(w.dequantize_rows(ids), ref[ids])
    # Flat bytes (as a file's tensor data comes) are accepted too.
    assert torch.equal(dequantized(PackedWeight.from_gguf(raw.reshape(-1), gguf_type, (n, k))),
                       ref)


def test_layouts_and_sizes():
    expect = {"Q4_0": ("u4", 32), "Q4_1": ("u4", 32), "Q4_K": ("u4", 32), "Q8_0": ("i8", 32),
              "Q5_0": ("i8", 32), "Q5_1": ("i8", 32), "Q5_K": ("i8", 32), "Q6_K": ("i8", 16),
              "IQ4_NL": ("i8", 32), "MXFP4": ("i8", 32), "F16": ("f16", 0),
              "BF16": ("bf16", 0)}
    for i, t in enumerate(TYPES):  # fresh weights: no panels made by other tests
        w = PackedWeight.from_gguf(random_raw(t, 96, 1536, seed=i), t, (96, 1536))
        assert (w.layout, w.group_size) == expect[t]
        per_weight = 8 * w.nbytes / (96 * 1536)
        if t in HALF_TYPES:
            assert w.is_half and w.scales is None and w.mins is None and per_weight == 16
            continue
        assert w.scales.shape == (96, 1536 // w.group_size)
        assert (w.mins is None) == (t in ("Q8_0", "Q5_0", "Q6_K", "IQ4_NL", "MXFP4"))
        # The 32-input types' tables are their f16 fields, kept at 16 bits: Q4_1 costs the
        # file's 5 bits a weight, Q8_0 8.5 (MXFP4's powers of two here too). A K-quant's
        # scales are products: float32.
        float16_tables = t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4")
        assert w.scales.dtype == (torch.int16 if float16_tables else torch.float32)
        table_bits = sum(32 * (tb is not None) for tb in (w.scales, w.mins)) / w.group_size
        bits = {"u4": 4, "i8": 8}[w.layout] + table_bits / (2 if float16_tables else 1)
        assert per_weight == bits, (t, per_weight)


def test_tables_stay_float32_unless_every_value_is_a_float16():
    raw = random_raw("Q4_0", 4, 64, seed=0)
    raw[1, 0:2] = np.array([60000.0], np.float16).view(np.uint8)  # min -8 d overflows float16
    w = PackedWeight.from_gguf(raw, "Q4_0", (4, 64))
    assert w.scales.dtype == w.mins.dtype == torch.float32 and w.mins[1, 0] == -480000.0
    assert torch.equal(dequantized(w), reference(raw, "Q4_0", 4, 64))
    compact = PackedWeight.from_gguf(random_raw("Q4_1", 4, 64, seed=1), "Q4_1", (4, 64))
    both = PackedWeight.cat([compact, w])  # mixed tables: widened to float32
    assert both.scales.dtype == torch.float32
    assert torch.equal(dequantized(both), torch.cat([dequantized(compact), dequantized(w)]))


@pytest.mark.parametrize("gguf_type", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 32, 300])
def test_linear_matches_dequantized_matmul(float_weights, gguf_type, rows):
    w, ref = float_weights[gguf_type]
    g = torch.Generator().manual_seed(rows)
    base = torch.randn(rows, 1536 + 40, generator=g)
    x = base[:, 13:13 + 1536]  # strided row view
    bias = torch.randn(96, generator=g)
    expect = x @ ref.T
    scale = expect.abs().max().item()
    torch.testing.assert_close(quantized_linear(x, w), expect, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(quantized_linear(x, w, bias), expect + bias, rtol=1e-4,
                               atol=1e-5 * scale)


@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "Q6_K", "BF16"])
def test_both_paths_agree_at_the_threshold(float_weights, gguf_type, monkeypatch):
    """The few-row kernel (the GEMV, or a 16-bit weight's panels) against the tiles."""
    w, ref = float_weights[gguf_type]
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(3))
    assert w.plan.kernel_for(9) is not LinearKernel.BLOCK_TILES
    gemv = quantized_linear(x, w)
    set_plan(monkeypatch, w, few_rows=0, many=LinearKernel.BLOCK_TILES)
    # 40-row tiles: a ragged last one
    monkeypatch.setattr(quantized_tiles, "TILE_ELEMENTS", 40 * 1536)
    tiled = quantized_linear(x, w)
    expect = x @ ref.T
    atol = 1e-5 * expect.abs().max().item()  # fp32 sums in another order, relative to the size
    torch.testing.assert_close(gemv, tiled, rtol=1e-4, atol=atol)
    torch.testing.assert_close(tiled, expect, rtol=1e-4, atol=atol)


@pytest.mark.usefixtures("float_activations")
@pytest.mark.parametrize("gguf_type", ["Q4_K", "Q5_1", "Q6_K", "F16"])
def test_rows_and_cat_round_trip(weights, gguf_type):
    w, ref = weights[gguf_type]
    parts = [w.rows(0, 10), w.rows(10, 64), w.rows(64, 96)]
    assert [p.out_features for p in parts] == [10, 54, 32]
    assert torch.equal(dequantized(parts[1]), ref[10:64])
    assert parts[1].q.untyped_storage().nbytes() < w.q.untyped_storage().nbytes()
    back = PackedWeight.cat(parts)
    assert back.gguf_type == gguf_type and back.nbytes == sum(p.nbytes for p in parts)
    assert torch.equal(dequantized(back), ref)
    x = torch.randn(2, 1536, generator=torch.Generator().manual_seed(4))
    expect = x @ ref[64:96].T  # fp32 sums in another order: tolerance relative to the size
    torch.testing.assert_close(quantized_linear(x, parts[2]), expect, rtol=1e-4,
                               atol=1e-5 * expect.abs().max().item())


def test_cat_of_same_layout_types_fills_missing_mins(weights):
    q8, ref8 = weights["Q8_0"]
    q51, ref51 = weights["Q5_1"]
    both = PackedWeight.cat([q8, q51])
    assert both.gguf_type == "Q8_0+Q5_1"
    assert torch.equal(dequantized(both), torch.cat([ref8, ref51]))


def test_errors(weights):
    raw = random_raw("Q4_0", 4, 64, seed=0)
    with pytest.raises(ValueError, match="unsupported"):
        PackedWeight.from_gguf(raw, "Q2_K", (4, 64))
    with pytest.raises(ValueError, match="unsupported"):
        PackedWeight.from_gguf(raw, "F32", (4, 64))
    with pytest.raises(ValueError, match="blocks"):
        PackedWeight.from_gguf(raw, "Q4_0", (4, 96))
    with pytest.raises(ValueError, match="cannot cat"):
        PackedWeight.cat([weights["Q4_0"][0], weights["Q8_0"][0]])
    with pytest.raises(ValueError, match="cannot cat"):
        PackedWeight.cat([weights["Q8_0"][0], weights["Q6_K"][0]])
    with pytest.raises(ValueError, match="cannot cat"):
        PackedWeight.cat([weights["F16"][0], weights["BF16"][0]])
    other_k = PackedWeight.from_gguf(random_raw("Q4_0", 2, 64, 1), "Q4_0", (2, 64))
    with pytest.raises(ValueError, match="cannot cat"):
        PackedWeight.cat([weights["Q4_0"][0], other_k])
    with pytest.raises(ValueError):
        quantized_linear(torch.randn(2, 64), weights["Q4_0"][0])
    with pytest.raises(IndexError):
        weights["Q4_0"][0].dequantize_rows(torch.tensor([96]))


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_1", "Q5_K", "Q6_K"])
def test_a_weight_held_as_its_group_panels(gguf_type):
    # 130 outputs: two whole panels and a ragged third.
    raw = random_raw(gguf_type, 130, 512, seed=7)
    w, ref = PackedWeight.from_gguf(raw, gguf_type, (130, 512)), reference(raw, gguf_type,
                                                                             130, 512)
    if w.plan.few is not LinearKernel.GROUP_PANELS:
        pytest.skip("the group panel kernel does not take this weight here")
    g = torch.Generator().manual_seed(8)
    x_rows, x_tiles = torch.randn(3, 512, generator=g), torch.randn(40, 512, generator=g)
    rows_before, tiles_before = quantized_linear(x_rows, w), quantized_linear(x_tiles, w)
    blocks_bytes = w.q.nbytes + w.scales.nbytes + (0 if w.mins is None else w.mins.nbytes)
    w.store_as_panels()
    assert w.panel_storage and w.q.shape == (130, 0) and w.scales.shape == (130, 0)
    assert w.plan.on_panels and w.plan.kernel_for(3) is LinearKernel.GROUP_PANELS
    # The panels hold the blocks' bytes (tables in the blocks' dtype), padded to 192 outputs; a
    # Q6_K's "u6" panels the file's (its f16 d a float32), where its bytes widened to int8 did,
    # Q4_0's the file's (no min table: its mins are -8 x its scales), Q4_K's "u4k" the file's
    # but a byte per six-bit scale and min and float32 supers (float32 tables per 32 before).
    file_row = {"Q6_K": raw.size // 130 + 2 * 512 // 256, "Q4_0": raw.size // 130,
                "Q4_K": raw.size // 130 + 8 * 512 // 256}
    expected = (192 * file_row[gguf_type] if gguf_type in file_row
                else blocks_bytes * 192 // 130)
    assert w.nbytes == expected
    assert torch.equal(dequantized(w), ref)
    assert torch.equal(w.dequantize_rows(torch.tensor([129, 0, 64])), ref[[129, 0, 64]])
    assert torch.equal(quantized_linear(x_rows, w), rows_before)  # the same kernel and panels
    # The tiles hold the same float32 weights; torch.mm may sum another tile shape in another
    # order.
    torch.testing.assert_close(quantized_linear(x_tiles, w), tiles_before, rtol=1e-5,
                               atol=1e-5 * tiles_before.abs().max().item())
    with pytest.raises(ValueError, match="its panels"):
        w.rows(0, 64)
    with pytest.raises(ValueError, match="its panels"):
        PackedWeight.cat([w, w])
    with pytest.raises(IndexError):
        w.dequantize_rows(torch.tensor([130]))


def test_blocks_are_not_held_as_panels_where_the_kernel_does_not_run(weights, monkeypatch):
    monkeypatch.setattr(quantized_panel_numba, "GROUP_PANELS_RUN", False)
    with pytest.raises(ValueError, match="does not run"):
        weights["Q6_K"][0].store_as_panels()
    assert not weights["Q6_K"][0].panel_storage


@pytest.mark.parametrize("gguf_type", HALF_TYPES)
def test_a_16_bit_weight_held_as_its_panels(gguf_type, monkeypatch):
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: False)
    raw = random_raw(gguf_type, 130, 96, seed=9)
    w, ref = PackedWeight.from_gguf(raw, gguf_type, (130, 96)), reference(raw, gguf_type,
                                                                            130, 96)
    if not half_panel_linear.panels_run_here():
        with pytest.raises(ValueError, match="does not run"):
            w.store_as_panels()
        return
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(10))
    before = quantized_linear(x, w)
    w.store_as_panels()
    assert w.panel_storage and w.q.shape == (130, 0) and w.plan.on_panels
    assert {w.plan.kernel_for(rows) for rows in (1, 32, 33)} == {LinearKernel.HALF_PANELS}
    assert w.nbytes == 192 * 96 * 2  # the panels alone, padded to three panels of 64
    assert torch.equal(dequantized(w), ref)
    assert torch.equal(quantized_linear(x, w), before)
    with pytest.raises(ValueError, match="its panels"):
        w.rows(0, 10)


@pytest.mark.parametrize("native", [False, True])
def test_16_bit_weights_run_on_matrix_units_from_min_native_rows(monkeypatch, native):
    """Where the CPU computes bfloat16 natively, MIN_NATIVE_HALF_ROWS rows and more run
    cpu_linear.native_16bit_linear; fewer rows, and any rows elsewhere, the GEMV or tiles."""
    calls = []
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: native)
    monkeypatch.setattr(cpu_linear, "native_16bit_linear",
                        lambda x, w, dtype, float32_sums=False:
                        calls.append(len(x)) or torch.zeros(len(x), 80))
    monkeypatch.setattr(cpu_linear, "onednn_pack", lambda weight: weight)  # no bf16 oneDNN
    w = PackedWeight.from_float(torch.randn(80, 300), torch.bfloat16)
    low = linear_plan.MIN_NATIVE_HALF_ROWS
    for rows in (1, low - 1, low, 40):
        quantized_linear(torch.randn(rows, 300), w)
    assert calls == ([low, 40] if native else [])


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("gguf_type", ["Q8_0", "BF16"])
def test_the_gemv_runs_up_to_the_plans_few_rows(gguf_type, native, monkeypatch):
    """`quantized_linear` runs the GEMV kernels (or the group panels') up to the plan's
    `few_rows` rows and none beyond (a 16-bit weight: the matrix units or the GEMV's paired
    rows from there on, or the panel kernel at every row count where it runs); the fused decode
    stack trusts it up to `numba_rows`, which the panels' and the paired rows count in. The
    plan's own bands: test_linear_plan.py."""
    calls = []
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: native)
    for module, name in ((quantized.quantized_numba, "gemv_groups"),
                         (quantized.dense_gemv_numba, "gemv_half"),
                         (quantized.quantized_panel_numba, "group_panel_kernel")):
        monkeypatch.setattr(module, name, lambda x, *args: calls.append(len(x)))
    monkeypatch.setattr(cpu_linear, "native_16bit_linear",
                        lambda x, w, dtype, float32_sums=False: torch.zeros(len(x), w.shape[0]))
    monkeypatch.setattr(cpu_linear, "onednn_pack", lambda weight: weight)  # no bf16 oneDNN
    w = PackedWeight.from_gguf(random_raw(gguf_type, 96, 1536, seed=0), gguf_type, (96, 1536))
    limit, panels = w.plan.few_rows, w.plan.few is LinearKernel.HALF_PANELS
    for rows in (1, limit, limit + 1):
        quantized_linear(torch.randn(rows, w.in_features), w)
    assert calls == ([] if panels else [1, limit])
    assert panels == (w.is_half and not native and half_panel_linear.panels_run_here())
    # Where neither matrix units nor panels serve a 16-bit weight, the GEMV's paired rows
    # (another numba kernel) take the rows after `few_rows`, up to the GEMV's most.
    pairs = w.plan.mid is LinearKernel.HALF_PAIRS
    assert pairs == (w.is_half and not native and not panels)
    assert limit == (linear_plan.MIN_NATIVE_HALF_ROWS - 1 if native and w.is_half
                     else linear_plan.MIN_HALF_PAIRS_ROWS - 1 if pairs
                     else linear_plan.MAX_QUANTIZED_GEMV_ROWS)
    assert w.plan.numba_rows == (linear_plan.MAX_QUANTIZED_GEMV_ROWS if pairs else limit)


@pytest.mark.parametrize("gguf_type", HALF_TYPES)
@pytest.mark.parametrize("n, k, rows", [(5, 3, 1), (33, 37, 3), (17, 8, 5), (9, 100, 2)])
@pytest.mark.usefixtures("float_activations")  # the GEMV at every row count, not oneDNN
def test_half_gemv_on_widths_that_are_not_multiples_of_8(gguf_type, n, k, rows):
    # The 8-wide loop leaves a scalar tail; the stored values widen exactly, so the only error
    # is float32 summation order.
    raw = random_raw(gguf_type, n, k, seed=k)
    w = PackedWeight.from_gguf(raw, gguf_type, (n, k))
    ref = reference(raw, gguf_type, n, k).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    expect = x.double() @ ref.T
    torch.testing.assert_close(quantized_linear(x, w).double(), expect, rtol=1e-5,
                               atol=1e-6 * expect.abs().max().item())


@pytest.mark.parametrize("dtype, unit_roundoff", [(torch.bfloat16, 2.0 ** -8),
                                                  (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.usefixtures("float_activations")
def test_float_weights_kept_in_16_bits_stay_within_the_rounding_bound(dtype, unit_roundoff, rows):
    # Derivation: rounding to nearest moves each weight by at most u |w| (u = 2^-8 for
    # bfloat16's 8-bit significand, 2^-11 for float16's 11; weights here are far above float16's
    # subnormal range), so each output moves by at most u * sum_k |w_rk| |x_mk|; the float32
    # sums add a few 2^-24 relative to the same sum. The error must also be real (the weights
    # are rounded), at least a thousandth of the bound somewhere.
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(64, 300, generator=g) * 0.05
    w += torch.sign(w) * 1e-3  # every |w| >= 1e-3: normal in float16
    x = torch.randn(rows, 300, generator=g)
    got = quantized_linear(x, PackedWeight.from_float(w, dtype)).double()
    exact = x.double() @ w.double().T
    bound = (unit_roundoff + 300 * 2.0 ** -24) * (x.double().abs() @ w.double().abs().T)
    error = (got - exact).abs()
    assert bool((error <= bound).all()), (error / bound).max().item()
    assert (error / bound).max().item() > 1e-3
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        PackedWeight.from_float(w, torch.int8)


def _panels_prefetch(w: PackedWeight) -> bool:
    """Whether `w` runs on group panels whose passes prefetch (the plan's rows beside a copy)."""
    return w.plan.few is LinearKernel.GROUP_PANELS and quantized_panel_numba.panels_prefetch(
        w.group_panels()[0].shape[2])


@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "Q6_K", "F16"])
@pytest.mark.parametrize("panels", [False, True])
def test_a_weight_with_a_bfloat16_copy_runs_it_from_the_plans_many_rows(gguf_type, panels,
                                                                        monkeypatch):
    """hold_bf16_copy: the weight's own kernel up to MAX_BLOCK_ROWS_BESIDE_COPY rows (group
    panels: MAX_GROUP_PANEL_ROWS_BESIDE_COPY), unchanged; from there the copy on the matrix
    units: the weight dequantized and rounded to bfloat16 once, a few rows at a time
    (COPY_ROWS), from blocks, float16 or panels alike."""
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: False)  # F16's plan
    raw = random_raw(gguf_type, 130, 256, seed=11)
    w = PackedWeight.from_gguf(raw, gguf_type, (130, 256))
    if panels:
        if not w.plan.on_panels and w.plan.few not in (LinearKernel.GROUP_PANELS,
                                                       LinearKernel.HALF_PANELS):
            pytest.skip("no panel kernel takes this weight here")
        w.store_as_panels()
    prefetch = _panels_prefetch(w)
    few = (linear_plan.MAX_GROUP_PANEL_ROWS_BESIDE_COPY if prefetch
           else linear_plan.MAX_BLOCK_ROWS_BESIDE_COPY)
    g = torch.Generator().manual_seed(12)
    x_few, x_many = torch.randn(few, 256, generator=g), torch.randn(few + 3, 256, generator=g)
    before, blocks_bytes = quantized_linear(x_few, w), w.nbytes
    if not cpu_linear.computes_natively(torch.bfloat16):  # bfloat16 oneDNN may not pack here
        monkeypatch.setattr(cpu_linear, "onednn_pack", lambda weight: weight)
    monkeypatch.setattr(quantized, "COPY_ROWS", 48)  # three chunks, the last ragged
    w.hold_bf16_copy()
    assert w.plan == linear_plan.with_bf16_copy(PackedWeight.from_gguf(
        raw, gguf_type, (130, 256)).plan, prefetch) and w.plan.native_from == few + 1
    assert w.bf16_copy.q.shape == (130, 0)  # the oneDNN form alone holds the copy
    assert w.nbytes == blocks_bytes + w.bf16_copy.onednn_packed().nbytes
    assert torch.equal(quantized_linear(x_few, w), before)
    copy = dequantized(w).bfloat16()
    assert torch.equal(w.bf16_copy.onednn_packed().to_dense(), copy)
    if cpu_linear.computes_natively(torch.bfloat16):
        expect = cpu_linear.native_16bit_linear(
            x_many, cpu_linear.onednn_pack(copy), torch.bfloat16)
        assert torch.equal(quantized_linear(x_many, w), expect)
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: True)
    with pytest.raises(ValueError, match="matrix units already"):
        PackedWeight.from_float(torch.randn(8, 64), torch.bfloat16).hold_bf16_copy()


@pytest.mark.skipif(not int8_linear.int8_products_run(), reason="oneDNN has no VNNI int8 here")
@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_1"])
def test_a_weight_with_an_int8_copy_runs_a_prompts_rows_on_it(gguf_type, monkeypatch):
    """hold_int8_copy (beside the bfloat16 copy): the rows below MIN_INT8_ROWS unchanged, a
    prompt's rows on int8 products of the weight's dequantized values (within
    test_int8_linear's bound: here, near the float32 product), chunk by chunk at load; an F16
    weight (no integer blocks) is refused."""
    raw = random_raw(gguf_type, 130, 256, seed=21)
    w = PackedWeight.from_gguf(raw, gguf_type, (130, 256))
    w.hold_bf16_copy()
    g = torch.Generator().manual_seed(22)
    below = torch.randn(linear_plan.MIN_INT8_ROWS - 1, 256, generator=g)
    prompt = torch.randn(linear_plan.MIN_INT8_ROWS + 30, 256, generator=g)
    before, copy_bytes = quantized_linear(below, w), w.nbytes
    monkeypatch.setattr(quantized, "COPY_ROWS", 48)  # three chunks, the last ragged
    w.hold_int8_copy()
    assert w.plan == linear_plan.with_int8_products(linear_plan.with_bf16_copy(
        PackedWeight.from_gguf(raw, gguf_type, (130, 256)).plan, _panels_prefetch(w)))
    assert w.nbytes == copy_bytes + w.int8_copy.nbytes
    assert torch.equal(quantized_linear(below, w), before)
    got, exact = quantized_linear(prompt, w), prompt @ dequantized(w).T
    assert torch.equal(got, int8_linear.int8_linear(prompt, w.int8_copy))
    assert (got - exact).abs().max() <= 0.03 * exact.abs().max()
    half = PackedWeight.from_gguf(random_raw("F16", 8, 64, seed=3), "F16", (8, 64))
    monkeypatch.setattr(half, "plan", linear_plan.with_bf16_copy(half.plan))
    with pytest.raises(ValueError, match="integer blocks"):
        half.hold_int8_copy()
