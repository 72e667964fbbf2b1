"""Software prefetches for numba kernels: LLVM's `llvm.prefetch` on an array element.

Why: the decode-attention kernel reads each row's K/V blocks from DRAM (the cache of a batch is
far larger than the L3) in a pattern the hardware prefetcher cannot guess (the next block's
address comes from the block table). Prefetching the next blocks while the current one is
computed keeps more loads in flight (bench/test_model_layers.py, decode-attention cases).

Two levels: `prefetch_at` fills every level down to L1 (x86 prefetcht0), `prefetch_to_l2_at`
stops at L2 (prefetcht1). The attention kernel's K/V stream takes the second: prefetched into
L1, the stream from DRAM barely overlapped the kernel's compute, as though the L1's few miss
buffers, held by the prefetched lines, had capped the loads in flight (bench/README.md has
the measurement).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

CACHE_LINE_BYTES = 64


def emit_prefetch(builder: ir.IRBuilder, ptr: ir.Value, byte_offset: ir.Value,
                  locality: int) -> None:
    """IR for a read prefetch of the cache line `byte_offset` bytes past `ptr`, with LLVM's
    `locality` (3: every level, 2: L2 and beyond on x86), for kernels that emit their own IR."""
    i8p = ir.IntType(8).as_pointer()
    address = builder.gep(builder.bitcast(ptr, i8p), [byte_offset])
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    # (address, rw = read, locality, cache type = data)
    builder.call(fn, [address, i32(0), i32(locality), i32(1)])


def _prefetch_intrinsic(name: str, locality: int, doc: str):
    """A numba intrinsic (array, index, byte_offset) that prefetches the cache line at
    `byte_offset` bytes past `array[index, 0, ...]` with LLVM's `locality` (3: every level, 2:
    L2 and beyond on x86). No effect on results; an address past the array is harmless
    (prefetches never fault), but callers keep within the array anyway."""

    def prefetch(typingctx, array, index, byte_offset):
        if not isinstance(array, types.Array):
            return None
        sig = types.void(array, index, byte_offset)

        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            arr = context.make_array(array_type)(context, builder, args[0])
            first = context.cast(builder, args[1], signature.args[1], types.intp)
            offset = context.cast(builder, args[2], signature.args[2], types.intp)
            zero = context.get_constant(types.intp, 0)
            ptr = cgutils.get_item_pointer(context, builder, array_type, arr,
                                           [first] + [zero] * (array_type.ndim - 1))
            emit_prefetch(builder, ptr, offset, locality)
            return context.get_dummy_value()

        return sig, codegen

    # Its own name, not the factory's: numba names the intrinsic by it in typing errors.
    prefetch.__name__ = prefetch.__qualname__ = name
    prefetch.__doc__ = doc
    return intrinsic(prefetch)


prefetch_at = _prefetch_intrinsic(
    "prefetch_at", 3, "Hint the CPU to load the cache line at `byte_offset` bytes past"
                      " `array[index, 0, ...]` into every level (prefetcht0).")
prefetch_to_l2_at = _prefetch_intrinsic(
    "prefetch_to_l2_at", 2, "As `prefetch_at`, into L2 and the levels beyond it, not L1"
                            " (prefetcht1).")
