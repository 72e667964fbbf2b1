"""A float32 exp for numba kernels that LLVM can vectorise.

Why: numba's `np.exp` on float32 is a scalar libm call (the pip llvmlite has no SVML), ~20
cycles per element with no SIMD: in a decode step's softmax (every row x head x context
position) and SiLU (every row x intermediate element) the exps cost more than the arithmetic
around them. `exp32` is Cephes' expf (range reduction by ln 2, a degree-5 polynomial, the
exponent set through the float's bits) written with plain arithmetic and one bit cast, so a
loop over it vectorises like any multiply-add loop.

Accuracy: within 3e-7 relative (2.5 ulp) of the exact value over [-87.3, 88]
(tests/models/test_numba_exp.py); inputs are clamped to that range, so exp32(x) is ~1.2e-38
for x < -87.3 (not 0) and ~1.65e38 for x > 88 (not inf): both harmless where it is used
(softmax terms, SiLU's 1 + exp(-x)).

Caching: kernels compiled with `cache=True` inline exp32, and numba keys each cache entry on
the kernel's own file only; after editing this file, delete the `__pycache__/*.nbi|*.nbc`
entries of attention/decode_numba.py, activation_numba.py and models/cpu/decode.py (a fresh
checkout has none).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from mrv2.utils.kernel_flags import FASTMATH

_LOG2E = np.float32(1.44269504088896341)
_C1 = np.float32(0.693359375)  # ln 2 split in two: C1 + C2 = ln 2 to ~1e-11
_C2 = np.float32(-2.12194440e-4)
_LO = np.float32(-87.3)
_HI = np.float32(88.0)  # exp(88) ~ 1.65e38; 2**n stays a normal float


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits`."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@njit(inline="always", fastmath=FASTMATH, error_model="numpy", cache=True)
def exp32(x):
    """exp(x) for a float32 x (see the module docstring for range and accuracy)."""
    x = min(max(x, _LO), _HI)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _C1 - n * _C2
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * r * r + r + np.float32(1.0)
    # 2**n through the exponent bits: n is in [-126, 127] after the clamp (a normal float).
    return y * _float32_from_bits(np.int32((np.int32(n) + 127) << 23))
