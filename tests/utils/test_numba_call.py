"""utils/numba_call.TypedCall: the overload numba would pick, for long-lived and new
arguments alike, with the same results as calling the kernel."""

from __future__ import annotations

import numpy as np
from numba import njit

from mrv2.utils.numba_call import TypedCall


@njit
def _weighted(rows, scales, out):
    for i in range(out.shape[0]):
        out[i] = rows[0][i] * scales[0] + rows[1][i] * scales[1]
    return out.sum()


def test_same_results_as_the_kernel_for_new_and_kept_arguments():
    call = TypedCall(_weighted)
    rows = (np.arange(4, dtype=np.float32), np.ones(4, np.float32))
    scales = (np.float32(2.0), np.float32(0.5))
    for step in range(3):
        out = np.empty(4, np.float32)
        assert call(rows, scales, out) == _weighted(rows, scales, np.empty(4, np.float32))
        assert out.tolist() == [0.5, 2.5, 4.5, 6.5]
    assert len(_weighted.overloads) == 1
    # A new argument of another type (float64) gets its own overload, as numba gives it.
    out64 = np.empty(4, np.float64)
    assert call(rows, scales, out64) == 14.0 and out64.tolist() == [0.5, 2.5, 4.5, 6.5]
    assert len(_weighted.overloads) == 2
    # A kept argument's type is reused only for that very object.
    other = (np.arange(4, dtype=np.float64), np.ones(4, np.float64))
    assert call(other, scales, out64) == 14.0
    assert len(_weighted.overloads) == 3


def test_a_new_arrays_type_is_numbas_and_the_last_overload_serves_the_same_types():
    """`_array_type` gives numba's typeof for every layout and writeability (a strided view,
    a read-only array, Fortran order, a size-1 array contiguous both ways); a call whose
    types are the last call's runs the last overload, one whose types differ looks its own
    up."""
    call = TypedCall(_weighted)
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    readonly = base.copy()
    readonly.flags.writeable = False
    for array in (base, base[:, ::2], readonly, np.asfortranarray(base), base[:1, :1],
                  np.zeros(3, np.int64), base.T):
        assert call._array_type(array) == _weighted.typeof_pyval(array)
    rows = (np.arange(4, dtype=np.float32), np.ones(4, np.float32))
    scales = (np.float32(2.0), np.float32(0.5))
    call(rows, scales, np.empty(4, np.float32))
    first = call._compiled
    assert call(rows, scales, np.empty(4, np.float32)) == 14.0 and call._compiled is first
    out64 = np.empty(4, np.float64)
    assert call(rows, scales, out64) == 14.0 and call._compiled is not first
    assert out64.tolist() == [0.5, 2.5, 4.5, 6.5]
