"""numba_rows: which tensors the layers' numba twins take, and the serial/parallel row split
(shown on the RMSNorm twin; the rotary and SiLU-and-mul twins split the same way)."""

from __future__ import annotations

import torch

from mrv2.models.layers import norm_numba
from mrv2.models.layers.numba_rows import SERIAL_MAX_ROWS, float32_cpu_inference


def test_parallel_form_is_taken_beyond_serial_max_rows(monkeypatch):
    calls = []
    real = norm_numba._add_rms_norm_rows

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(norm_numba, "_add_rms_norm_rows", counted)
    weight = torch.ones(8)
    with torch.no_grad():
        norm_numba.rms_norm(torch.ones(SERIAL_MAX_ROWS, 8), weight, 1e-5)
        norm_numba.rms_norm(torch.ones(SERIAL_MAX_ROWS + 1, 8), weight, 1e-5)
    assert calls == [SERIAL_MAX_ROWS + 1]


def test_float32_cpu_inference_only():
    x = torch.zeros(2, 4)
    with torch.no_grad():
        assert float32_cpu_inference(x, x)
        assert not float32_cpu_inference(x, x.double())
        assert not float32_cpu_inference(torch.zeros(2, 2, 4))
        assert float32_cpu_inference(torch.zeros(4096, 4))  # prefills: the parallel form
    assert not float32_cpu_inference(x)  # autograd on: the torch path keeps the graph


def test_typed_list_holds_the_items_themselves_in_order():
    import numpy as np

    from mrv2.models.layers.numba_rows import typed_list

    arrays = tuple(np.full((2, 3), i, np.float32) for i in range(4))
    listed = typed_list(arrays)
    assert len(listed) == 4
    assert [int(a[0, 0]) for a in listed] == [0, 1, 2, 3]
    arrays[2][1, 1] = 7.0  # views, not copies: an in-place change is seen
    assert listed[2][1, 1] == 7.0
