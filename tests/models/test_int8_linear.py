"""int8_linear: rows rounded to int8 per row (with their padding; the MLP activation in the same
pass), a weight per output row from chunks, and the product within the module's derived bound
of the exact one (and equal, up to the output roundings, to the product of the int8 values
themselves)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.models.layers import int8_linear
from mrv2.models.layers.cpu_linear import padded_rows
from mrv2.models.layers.int8_linear import X_OFFSET, Int8Weight, int8_rows

needs_onednn_int8 = pytest.mark.skipif(
    not hasattr(getattr(torch.ops, "onednn", None), "qlinear_pointwise")
    or not torch.backends.mkldnn.is_available(), reason="torch has no oneDNN int8 linear")


def _weight(w: torch.Tensor, chunk: int) -> Int8Weight:
    return Int8Weight.from_row_chunks((w[i:i + chunk] for i in range(0, w.shape[0], chunk)),
                                      *w.shape)


def _int8_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of each row of a float32 weight, as Int8Weight rounds them, in float64."""
    scale = t.abs().amax(dim=1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.round(t * inverse[:, None]).double(), scale.double()


def test_rows_round_to_int8_at_their_own_scale_and_padding_rows_are_zero():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, 40, generator=g) * torch.logspace(-3, 3, 19)[:, None]
    x[4] = 0  # a zero row: scale 0, every value at the offset
    qx, sx = int8_rows(x)
    assert qx.shape == (padded_rows(19), 40) and qx.dtype == torch.uint8
    assert torch.all(qx[19:] == X_OFFSET)
    q, scale = _int8_parts(x)
    assert torch.allclose(sx.double(), scale, rtol=1e-6, atol=0)
    assert (qx[:19].long() - X_OFFSET - q.long()).abs().max() <= 1  # ties may round apart
    assert torch.all((x.double() - q * sx.double()[:, None]).abs()
                     <= sx.double()[:, None] / 2 * (1 + 1e-5))
    assert torch.equal(qx[4], torch.full((40,), X_OFFSET, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bfloat16: expected float32"):
        int8_rows(x.bfloat16())


@needs_onednn_int8
def test_a_weight_from_chunks_is_the_weight_from_one():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 64, generator=g)
    w[3] = 0
    whole, chunked = _weight(w, 70), _weight(w, 32)  # three chunks, the last ragged
    for field in ("scales", "offset_bias"):
        assert torch.equal(getattr(whole, field), getattr(chunked, field))
    q, scale = _int8_parts(w)
    assert torch.allclose(whole.scales.double(), scale, rtol=1e-6, atol=0)
    assert torch.allclose(whole.offset_bias.double(), -X_OFFSET * scale * q.sum(1),
                          rtol=1e-6, atol=1e-12)
    assert whole.nbytes >= 70 * 64 and (whole.out_features, whole.in_features) == (70, 64)
    with pytest.raises(ValueError, match="gave 32 rows, not 70"):
        Int8Weight.from_row_chunks([w[:32]], 70, 64)


@needs_onednn_int8
@pytest.mark.parametrize("rows", [1, 17, 100])
def test_the_product_is_within_the_derived_bound(rows):
    """|y - x.w| <= sum_k (|x| sw / 2 + |w| sx / 2 + sx sw / 4) + float32 roundings, and y
    is the product of the int8 values, scaled, up to those roundings."""
    g = torch.Generator().manual_seed(rows)
    k, n = 96, 48
    x = torch.randn(rows, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 7] *= 20  # an outlier input column
    weight = _weight(w, 32)
    y = int8_linear.int8_linear(x, weight).double()
    assert y.shape == (rows, n)
    xd, wd = x.double(), w.double()
    qx, sx = int8_rows(x)  # x's own int8 values (the test above checks them)
    qx, sx = qx[:rows].double() - X_OFFSET, sx.double()
    qw, sw = _int8_parts(w)
    of_ints = (qx @ qw.T) * sx[:, None] * sw[None, :]
    ulp = 2.0 ** -22  # two float32 roundings of half an ulp, with room
    offset = 2.0 ** -22 * X_OFFSET * sw[None, :] * qw.abs().sum(1)[None, :] * sx[:, None]
    rounding = ulp * of_ints.abs() + offset + 1e-30
    assert torch.all((y - of_ints).abs() <= rounding)
    bound = (xd.abs() @ (sw[:, None] / 2).expand(n, k).T
             + (sx[:, None] / 2) * wd.abs().sum(1)[None, :]
             + k * sx[:, None] * sw[None, :] / 4)
    assert torch.all((y - xd @ wd.T).abs() <= bound + rounding)


@needs_onednn_int8
def test_bad_inputs_are_refused():
    weight = _weight(torch.randn(8, 32), 8)
    with pytest.raises(ValueError, match="does not fit"):
        int8_linear.int8_linear(torch.randn(3, 16), weight)


def test_int8_products_need_vnni(monkeypatch):
    from mrv2 import cpu_caps

    int8_linear.int8_products_run.cache_clear()
    monkeypatch.setattr(cpu_caps, "caps", lambda: cpu_caps.CpuCaps(avx2=True))
    assert not int8_linear.int8_products_run()
    int8_linear.int8_products_run.cache_clear()
    monkeypatch.undo()
    assert int8_linear.int8_products_run() == (cpu_caps.caps().int8_vnni and np.bool_(
        hasattr(torch.ops.onednn, "qlinear_pointwise")))
    int8_linear.int8_products_run.cache_clear()


def test_the_mlp_activation_becomes_int8_rows_in_one_pass():
    """silu_and_mul_int8_rows: gate/up's sums times their row scales, silu(gate) * up as
    activation_numba computes it in float32, rounded as int8_rows rounds it."""
    from mrv2.models.layers.activation_numba import silu_and_mul

    g = torch.Generator().manual_seed(3)
    rows, width = 21, 40
    sums = torch.randn(padded_rows(rows), 2 * width, generator=g) * 40
    scales = torch.rand(rows, generator=g) * 0.1
    act, act_scales = int8_linear.silu_and_mul_int8_rows(sums, scales)
    want, want_scales = int8_rows(silu_and_mul(sums[:rows] * scales[:, None]))
    assert torch.equal(act, want) and torch.equal(act_scales, want_scales)


@needs_onednn_int8
def test_int8_sums_take_int8_rows_only():
    weight = _weight(torch.randn(8, 32), 8)
    with pytest.raises(ValueError, match="do not fit"):
        int8_linear.int8_sums(torch.zeros(3, 32, dtype=torch.int8), weight)
    with pytest.raises(ValueError, match="do not fit"):
        int8_linear.int8_sums(torch.zeros(3, 16, dtype=torch.uint8), weight)
