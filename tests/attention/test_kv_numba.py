"""The numba kernels' view of KV cache elements: 16-bit caches as int16 / uint16 bit patterns,
widened exactly and narrowed as torch rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from mrv2.attention import kv_numba


@njit(cache=True)
def _store_all(cache, values):
    for i in range(values.shape[0]):
        kv_numba.store(cache, 0, i, 0, 0, values[i])


@njit(cache=True)
def _widen_all(cache, out):
    for i in range(out.shape[0]):
        out[i] = kv_numba.widen(cache[0, i, 0, 0])


SPECIALS = [0.0, -0.0, 1.0, 1 / 3, 65504.0, 65520.0, 70000.0, 6e-8, -2.5e-8, 1e-40,
            3.39e38, 3.4e38, float("inf"), -float("inf"),
            1.00390625, 1.01171875, 1.0009765625, 1.0029296875]  # bf16 / f16 ties


@pytest.mark.parametrize("dtype", kv_numba.NUMBA_KV_DTYPES)
def test_store_rounds_as_torch_and_widen_is_exact(dtype):
    values = torch.cat([torch.tensor(SPECIALS), torch.randn(2000) * 10.0 ** torch.randint(
        -6, 6, (2000,), generator=torch.Generator().manual_seed(0))]).float()
    cache = torch.zeros(1, len(values) + 1, 1, 1, dtype=dtype)
    view = kv_numba.numpy_view(cache)
    _store_all(view, values.numpy())
    stored = cache[0, :len(values), 0, 0]
    assert torch.equal(stored.view(torch.int16), values.to(dtype).view(torch.int16)) \
        if dtype != torch.float32 else torch.equal(stored, values)
    widened = np.empty(len(values), np.float32)
    _widen_all(view, widened)
    assert torch.equal(torch.from_numpy(widened), stored.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nan_stays_nan(dtype):
    cache = torch.zeros(1, 2, 1, 1, dtype=dtype)
    _store_all(kv_numba.numpy_view(cache), np.array([np.nan, -np.nan], np.float32))
    assert cache.isnan().sum() == 2


def test_numpy_view_shares_memory_and_refuses_other_dtypes():
    cache = torch.zeros(2, 3, 4, 1, 2, dtype=torch.bfloat16)
    view = kv_numba.numpy_view(cache[1])
    assert view.dtype == np.uint16 and view.shape == (3, 4, 1, 2)
    view[0, 0, 0, 0] = 0x3F80  # bfloat16 1.0
    assert cache[1, 0, 0, 0, 0].item() == 1.0
    assert kv_numba.numpy_view(cache.half()).dtype == np.int16
    with pytest.raises(TypeError, match="float64"):
        kv_numba.numpy_view(cache.double())
