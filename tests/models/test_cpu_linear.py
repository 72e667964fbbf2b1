"""cpu_linear.linear against F.linear on every path (GEMV, oneDNN packed, fallback), and the
packed-weight cache's invalidation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mrv2.models.layers import cpu_gemv, cpu_linear, dot_linear, tile_linear
from mrv2.models.layers.vector_ir import half_bits

needs_onednn = pytest.mark.skipif(not cpu_linear.available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 4, 5, 17, 32, 300])  # 17, 300: padded
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(130, 96, generator=gen)
    b = torch.randn(130, generator=gen) if bias else None
    torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b), rtol=1e-5,
                               atol=1e-4)


@needs_onednn
@torch.no_grad()
def test_packed_weight_is_cached_and_repacked_after_in_place_changes():
    w = torch.randn(64, 32)
    x = torch.randn(cpu_gemv.MAX_GEMV_ROWS + 3, 32)
    first = cpu_linear.packed_weight(w)
    assert cpu_linear.packed_weight(w) is first  # packed once
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    w.mul_(-2.0)  # e.g. weights reloaded in place
    assert cpu_linear.packed_weight(w) is not first
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
@torch.no_grad()
def test_onednn_pack_puts_the_packed_weight_on_huge_pages(monkeypatch):
    """Both packings (float32 here, PackedWeight.onednn_packed for 16-bit) go through
    onednn_pack, which collapses the packed memory; the products are oneDNN's as before."""
    from mrv2.utils import huge_pages

    collapsed = []
    monkeypatch.setattr(huge_pages, "collapse", lambda ts: collapsed.extend(ts) or len(ts))
    monkeypatch.setenv(huge_pages.WEIGHTS_ENV, "1")
    w, x = torch.randn(96, 64), torch.randn(20, 64)
    packed = cpu_linear.packed_weight(w)
    assert [huge_pages.memory_of(t) for t in collapsed] == [huge_pages.memory_of(packed)]
    expected = cpu_linear.onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(w))
    assert torch.equal(cpu_linear.onednn_linear(x, packed), expected)


@torch.no_grad()
def test_parameters_and_strided_inputs():
    layer = torch.nn.Linear(48, 40)
    x = torch.randn(48, 10).t()  # [10, 48], not contiguous
    torch.testing.assert_close(cpu_linear.linear(x, layer.weight, layer.bias), layer(x),
                               rtol=1e-5, atol=1e-5)
    wt = torch.randn(48, 40).t()  # a non-contiguous weight skips the GEMV
    one = torch.randn(1, 48)
    torch.testing.assert_close(cpu_linear.linear(one, wt), F.linear(one, wt), rtol=1e-5,
                               atol=1e-5)


def test_autograd_other_dtypes_and_shapes_use_f_linear():
    w = torch.randn(16, 8)
    x = torch.randn(6, 8, requires_grad=True)
    cpu_linear.linear(x, w).sum().backward()  # grad mode: F.linear keeps the graph
    assert x.grad is not None
    with torch.no_grad():
        for xi, wi in [(torch.randn(6, 8).double(), w.double()),
                       (torch.randn(2, 3, 8), w), (torch.randn(0, 8), w)]:
            torch.testing.assert_close(cpu_linear.linear(xi, wi), F.linear(xi, wi))


def test_padded_rows_bound_the_shapes_and_the_padding():
    sizes = [cpu_linear.padded_rows(m) for m in range(1, 8193)]
    assert sizes[:16] == list(range(1, 17))
    assert all(m <= p <= m * 9 / 8 for m, p in enumerate(sizes, start=1))
    assert len(set(sizes)) == 16 + 8 * 9  # 8 sizes an octave from 17 to 8192
    assert all(cpu_linear.padded_rows(p) == p for p in set(sizes))  # padded sizes are fixed points


@needs_onednn
@torch.no_grad()
def test_every_row_count_leaves_memory_to_the_padded_sizes():
    """oneDNN keeps a compiled primitive per input shape (~0.65 MB each on Zen 3): 384 row
    counts unpadded grew the process by ~250 MB; padded they make 37 shapes."""
    import os

    from mrv2.testing.soak import rss_bytes

    w = torch.randn(256, 64)
    cpu_linear.linear(torch.randn(400, 64), w)
    before = rss_bytes(os.getpid())
    for rows in range(17, 401):
        cpu_linear.linear(torch.randn(rows, 64), w)
    assert len({cpu_linear.padded_rows(m) for m in range(17, 401)}) == 37
    assert rss_bytes(os.getpid()) - before < 100 << 20


def bf16_matrix_unit_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output, how far `native_16bit_linear` (bfloat16) may be from x @ w.T (w exact in
    bfloat16). Derivation: x is rounded to bfloat16 (each |x_k| moves by at most u |x_k|,
    u = 2^-8), the products of the rounded x and the exact weights are summed in float32 (a
    few 2^-24 of sum |x| |w|), and the sum is rounded to bfloat16 once (u |out| <= u sum |x|
    |w|): |error| <= (2u + K 2^-24) sum_k |x_k| |w_k|."""
    return (2 * 2.0 ** -8 + w.shape[1] * 2.0 ** -24) * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("rows", [1, 8, 45])
def test_native_16bit_linear_stays_within_the_rounding_bound(rows):
    # Where oneDNN has no bfloat16 kernels for this CPU, mrv2 never takes this path
    # (computes_natively is False).
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 kernels for this CPU")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(80, 300, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, 300, generator=g)
    out = cpu_linear.native_16bit_linear(x, torch.ops.mkldnn._reorder_linear_weight(w),
                                         torch.bfloat16)
    assert out.dtype == torch.float32 and out.shape == (rows, 80)
    bound = bf16_matrix_unit_bound(x, w)
    error = (out.double() - x.double() @ w.double().T).abs()
    assert bool((error <= bound).all()), (error / bound).max().item()
    assert (error / bound).max().item() > 1e-3  # the rounding is real


def test_computes_natively_needs_onednn(monkeypatch):
    monkeypatch.setattr(cpu_linear.platform, "cpu_computes_natively", lambda dtype: True)
    cpu_linear.computes_natively.cache_clear()
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    try:
        assert not cpu_linear.computes_natively(torch.bfloat16)
        monkeypatch.setattr(cpu_linear, "available", lambda: True)
        cpu_linear.computes_natively.cache_clear()
        assert cpu_linear.computes_natively(torch.bfloat16)
    finally:
        cpu_linear.computes_natively.cache_clear()


few_rows = pytest.mark.skipif(not (tile_linear.usable() or dot_linear.runs_here()),
                              reason="this CPU has neither AMX tiles nor AVX-512 BF16")


@few_rows
@pytest.mark.parametrize("rows, on_kernel", [(2, True), (cpu_linear.FEW_ROWS_MAX, True),
                                             (cpu_linear.FEW_ROWS_MAX + 1, False)])
def test_half_linear_takes_the_few_row_kernel_up_to_its_rows(monkeypatch, rows, on_kernel):
    w = torch.randn(128, 96).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    calls = []
    real = cpu_linear.few_rows_linear
    monkeypatch.setattr(cpu_linear, "few_rows_linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, 96).bfloat16()
    out = cpu_linear.half_linear(x, packed)
    assert bool(calls) is on_kernel
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=2e-2, atol=5e-2)


@few_rows
def test_few_rows_view_is_this_cpus_kernels_and_the_kernel_follows_it():
    """AMX tiles (4-d) where the CPU has them, else AVX-512 BF16 pairs (3-d); the same
    products from Python and from numba code (few_rows_kernel's overload)."""
    from numba import njit

    w = torch.randn(128, 64).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    view = cpu_linear.few_rows_view(packed)
    assert view.ndim == (4 if tile_linear.usable() else 3)
    assert cpu_linear.few_rows_view(torch.ops.mkldnn._reorder_linear_weight(w.float())) is None
    x = half_bits(torch.randn(3, 64).bfloat16())
    out, from_numba = np.empty((3, 128), np.uint16), np.empty((3, 128), np.uint16)
    cpu_linear.few_rows_kernel(x, view, out, 2)
    njit(lambda *a: cpu_linear.few_rows_kernel(*a))(x, view, from_numba, 2)
    np.testing.assert_array_equal(out, from_numba)
    np.testing.assert_array_equal(out, half_bits(cpu_linear.half_linear(
        torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), packed)))


def bf16_float32_sums_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output, how far `native_16bit_linear(..., float32_sums=True)` may be from x @ w.T:
    `bf16_matrix_unit_bound` without the last rounding to bfloat16 (one u of sum |x| |w|)."""
    return (2.0 ** -8 + w.shape[1] * 2.0 ** -24) * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("rows", [1, 2, 7, 33, cpu_linear.FEW_ROWS_MAX + 9])
@pytest.mark.parametrize("outputs", [128, 100])  # 100: no few-row kernel reads the packing
def test_native_16bit_float32_sums_are_not_rounded(rows, outputs):
    """The LM head's path (issue 47: logits rounded to bfloat16 tied the France prompt's top
    two tokens): float32 sums at every row count, within the bound without the last
    rounding, and, where a few-row kernel runs, the very sums `half_linear` rounds."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 kernels for this CPU")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(outputs, 96, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, 96, generator=g) * 4
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    out = cpu_linear.native_16bit_linear(x, packed, torch.bfloat16, float32_sums=True)
    assert out.dtype == torch.float32 and out.shape == (rows, outputs)
    error = (out.double() - x.double() @ w.double().T).abs()
    assert bool((error <= bf16_float32_sums_bound(x, w)).all())
    assert not torch.equal(out, out.bfloat16().float())  # not on the bfloat16 grid
    if cpu_linear.few_rows_view(packed) is not None:
        rounded = cpu_linear.few_rows_linear(x.bfloat16(), cpu_linear.few_rows_view(packed))
        assert torch.equal(out.bfloat16(), rounded)


@few_rows
def test_the_few_row_kernels_write_float32_sums_from_numba_code_too():
    """`store_sums` picks by the output's dtype inside the kernel: float32 out holds the
    sums that bfloat16 out holds rounded."""
    from numba import njit

    w = torch.randn(128, 64).bfloat16()
    view = cpu_linear.few_rows_view(torch.ops.mkldnn._reorder_linear_weight(w))
    x = half_bits(torch.randn(5, 64).bfloat16())
    sums, rounded = np.empty((5, 128), np.float32), np.empty((5, 128), np.uint16)
    njit(lambda *a: cpu_linear.few_rows_kernel(*a))(x, view, sums, 2)
    cpu_linear.few_rows_kernel(x, view, rounded, 2)
    np.testing.assert_array_equal(half_bits(torch.from_numpy(sums).bfloat16()), rounded)
