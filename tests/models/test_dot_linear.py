"""dot_linear: the AVX-512 BF16 kernel against the exact sum of the same bfloat16 values (and
oneDNN's linear on the same packed weight), and the parts that run on any CPU (the layout
reference, where the kernel does not run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2 import cpu_caps
from mrv2.models.layers import cpu_linear, dot_linear, tile_linear
from mrv2.models.layers.vector_ir import half_bits

dot = pytest.mark.skipif(not dot_linear.runs_here(),
                         reason="this CPU has no AVX-512 BF16, or has AMX tiles instead")


def _packed(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return w, torch.ops.mkldnn._reorder_linear_weight(w)


def _assert_within_the_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Each output within one bfloat16 rounding of the exact sum plus K float32 roundings of
    the running sum (each bounded by the sum of the products' magnitudes)."""
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    bound = exact.abs() * 2.0 ** -8 + magnitude * x.shape[1] * 2.0 ** -24
    assert ((out.double() - exact).abs() <= bound).all()


def test_pairs_of_is_the_blocked_layout():
    n, k = 128, 6
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    pairs = dot_linear.pairs_of(w)
    assert pairs.shape == (n // 64, k // 2, 128)
    for block, pair, col in [(0, 0, 0), (1, 2, 127), (0, 1, 33), (1, 0, 64)]:
        # a block's pair row holds its 64 outputs' two consecutive inputs each
        assert pairs[block, pair, col] == w[block * 64 + col // 2, pair * 2 + col % 2]


@dot
@pytest.mark.parametrize("n, k", [(960, 576), (3072, 576), (576, 1536), (128, 64)])
def test_weight_pairs_views_onednns_packing_in_place(n, k):
    w, packed = _packed(n, k)
    view = dot_linear.weight_pairs(packed)
    np.testing.assert_array_equal(view, half_bits(dot_linear.pairs_of(w)))
    assert view.ctypes.data == torch.ops.mkldnn.data_ptr(packed)  # no copy
    assert dot_linear.weight_pairs(packed) is view  # kept on the packed tensor


@pytest.mark.parametrize("n, k, dtype", [(96, 64, torch.bfloat16), (128, 64, torch.float32)])
def test_no_view_where_the_kernel_cannot_read_the_weight(n, k, dtype):
    """Outputs not a multiple of 64, or a float32 packing, stay on oneDNN (as everything does
    on a CPU where the kernel does not run)."""
    if not cpu_caps.caps().native_16bit(dtype):
        pytest.skip(f"oneDNN packs {dtype} only where the CPU computes it")
    w = torch.randn(n, k).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    assert dot_linear.weight_pairs(packed) is None


def test_the_kernel_runs_where_tile_linears_does_not():
    assert not (dot_linear.runs_here() and tile_linear.usable())


@dot
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 32, 64])
@pytest.mark.parametrize("n, k", [(192, 576), (64, 1536)])
def test_kernel_is_the_exact_sum_rounded(rows, n, k):
    w, packed = _packed(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows)).bfloat16()
    out = cpu_linear.few_rows_linear(x, dot_linear.weight_pairs(packed))
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    _assert_within_the_bound(out, x, w)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    _assert_within_the_bound(onednn, x, w)  # the same bound holds for oneDNN's order


@dot
def test_kernel_writes_into_out_on_more_threads_than_blocks():
    w, packed = _packed(64, 64)
    x = torch.randn(3, 64).bfloat16()
    view = dot_linear.weight_pairs(packed)
    out = torch.full((3, 64), float("nan"), dtype=torch.bfloat16)
    dot_linear.dot_linear_kernel(half_bits(x), view, half_bits(out), 4)
    _assert_within_the_bound(out, x, w)
    assert cpu_linear.few_rows_linear(x, view, out) is out
    assert cpu_linear.few_rows_linear(x[:0], view).shape == (0, 64)


@dot
def test_special_values_round_as_torch():
    """Infinities and NaN pass through the sums and the rounding as in float32 arithmetic."""
    w, packed = _packed(64, 64)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[0, 0], x[1, 1] = float("inf"), float("nan")
    out = cpu_linear.few_rows_linear(x, dot_linear.weight_pairs(packed)).float()
    expected = torch.where(w[:, 0].float() > 0, float("inf"), float("-inf"))
    assert torch.equal(out[0], expected)
    assert out[1].isnan().all()
