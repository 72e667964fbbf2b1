"""exp32 against float64 exp: accuracy over its range, the clamps, and use inside a loop."""

from __future__ import annotations

import numpy as np
from numba import njit

from mrv2.models.layers.numba_exp import exp32


@njit(fastmath=True, error_model="numpy", cache=False)
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = exp32(x[i])


def _exp(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    _exp_all(x, out)
    return out


def test_relative_error_within_3e_7_over_the_range():
    x = np.linspace(-87.3, 88.0, 1_000_001).astype(np.float32)
    # Also every float32 near 0, where the polynomial alone decides.
    x = np.concatenate([x, np.linspace(-1.0, 1.0, 200_001).astype(np.float32)])
    exact = np.exp(x.astype(np.float64))
    rel = np.abs(_exp(x).astype(np.float64) - exact) / exact
    assert rel.max() < 3e-7, (rel.max(), x[rel.argmax()])


def test_exact_at_zero_and_monotone_on_a_fine_grid():
    assert _exp(np.zeros(1, np.float32))[0] == 1.0
    y = _exp(np.linspace(-20.0, 20.0, 100_001).astype(np.float32))
    assert (np.diff(y) >= 0).all()


def test_clamped_outside_the_range_never_inf_or_nan():
    x = np.array([-np.inf, -1e30, -100.0, -87.3, 88.0, 100.0, 1e30, np.inf], np.float32)
    y = _exp(x)
    assert np.isfinite(y).all() and (y > 0).all()
    assert y[0] == y[1] == y[2] == y[3]  # the lower clamp: exp(-87.3) ~ 1.2e-38
    assert y[4] == y[5] == y[6] == y[7]  # the upper clamp: exp(88) ~ 1.65e38
    np.testing.assert_allclose(y[[3, 4]], np.exp(x[[3, 4]].astype(np.float64)), rtol=3e-7)


def test_softmax_through_it_matches_float64():
    rng = np.random.default_rng(0)
    scores = (rng.standard_normal(4096) * 8).astype(np.float32)
    e = _exp(scores - scores.max())
    exact = np.exp(scores.astype(np.float64) - scores.max())
    np.testing.assert_allclose(e / e.sum(), exact / exact.sum(), rtol=1e-6, atol=1e-12)
