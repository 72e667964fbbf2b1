"""The floating-point flags every CPU kernel compiles with: fast, and the same bits whether a
kernel was compiled in this process or loaded from numba's on-disk cache.

Why not numba's plain fastmath (LLVM's "fast": reassoc, contract, arcp, afn, nnan, ninf,
nsz): a kernel compiled in the process runs its callees (a parallel region's body, every njit
function it calls) as they were optimised on their own, while the cached object holds them
optimised a second time inside the caller's module. With reassociation allowed the two
optimisations vectorise the same sums differently, so the first run after an install and
every later run gave different bits (decode attention: up to 4 float32 ulps in ~12% of
outputs, enough to flip greedy tokens ten tokens in; tests/utils/test_kernel_flags.py).
Without "reassoc", "arcp" and "afn" LLVM must keep every sum in the order the source writes
it, so both optimisations compute the same values. A sum that must run on vectors is written
with its lanes explicit (norm_numba, decode_numba's softmax), which fixes its order too.

Kept: "contract" (a multiply and the add of its product fused into one FMA, exactly rounded
once: the explicit vector IR and the loops lose much of their speed without it) and the
assumptions that no value is NaN or infinite and that zeros' signs do not matter.
"""

from __future__ import annotations

# numba's `fastmath=` option for every CPU kernel (njit, overload jit_options); a set, as numba
# takes it (a frozenset is refused). Not to be changed at run time: compiled kernels keep theirs.
FASTMATH: set[str] = {"contract", "nnan", "ninf", "nsz"}
# The same flags on the float instructions of the LLVM vector IR the kernels' intrinsics emit.
IR_FLAGS: tuple[str, ...] = tuple(sorted(FASTMATH))
