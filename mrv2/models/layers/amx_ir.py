"""AMX tile instructions for numba kernels (tile_linear.py): LLVM's x86 AMX intrinsics, each
wrapped as a numba intrinsic over numpy arrays.

AMX gives each thread eight tile registers (tmm0-7) of up to 16 rows x 64 bytes, shaped by a
64-byte configuration (`tile_config`), and a matrix multiply-add on them (`tile_dot_bf16`:
C [rows, 16 float32] += A [rows, 32 bfloat16] . B [16 pairs of rows, 16 x 2 bfloat16], B's K
in interleaved pairs). Tile numbers are immediates in the instructions, so they must be
integer literals in the calling kernel. A thread must load a configuration before its first
tile instruction and should release the tiles after its last (`tile_release`), and the
process must have asked the kernel for AMX state (`torch.cpu._init_amx`, tile_linear.usable).
Only for CPUs with AMX (`cpu_caps.CpuCaps.matrix_tiles`): elsewhere the instructions fault.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I64 = ir.IntType(8), ir.IntType(64)
_I8P = _I8.as_pointer()
_VOID = ir.VoidType()


def _call(builder, name: str, arg_types: list, args: list) -> None:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VOID, arg_types), name)
    builder.call(fn, args)


def _byte_address(context, builder, array_type, array, byte_offset):
    """The address `byte_offset` bytes past the start of a numba array's data."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(builder.bitcast(data, _I8P), [byte_offset])


def _tile_number(value) -> bool:
    return isinstance(value, types.IntegerLiteral) and 0 <= value.literal_value < 8


@intrinsic
def tile_config(typingctx, config):
    """Load a 64-byte tile configuration (a uint8 array: palette 1 in byte 0, each tile's bytes
    per row as uint16 at 16 + 2 t, its rows at 48 + t). Zeroes every tile."""
    if not isinstance(config, types.Array):
        return None

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.ldtilecfg", [_I8P],
              [_byte_address(context, builder, signature.args[0], args[0], _I64(0))])
        return context.get_dummy_value()

    return types.void(config), codegen


@intrinsic
def tile_release(typingctx):
    """Return the thread's tiles to their initial state (no configuration)."""
    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic(prefer_literal=True)
def tile_zero(typingctx, tile):
    """Zero tile `tile` (a literal 0-7)."""
    if not _tile_number(tile):
        return None

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilezero", [_I8], [_I8(signature.args[0].literal_value)])
        return context.get_dummy_value()

    return types.void(tile), codegen


def _strided_tile_op(name: str, doc: str):
    @intrinsic(prefer_literal=True)
    def op(typingctx, tile, array, byte_offset, stride):
        if not (_tile_number(tile) and isinstance(array, types.Array)
                and isinstance(byte_offset, types.Integer) and isinstance(stride, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            offset = context.cast(builder, args[2], signature.args[2], types.int64)
            row_stride = context.cast(builder, args[3], signature.args[3], types.int64)
            address = _byte_address(context, builder, signature.args[1], args[1], offset)
            _call(builder, name, [_I8, _I8P, _I64],
                  [_I8(signature.args[0].literal_value), address, row_stride])
            return context.get_dummy_value()

        return types.void(tile, array, byte_offset, stride), codegen

    op.__doc__ = doc
    return op


tile_load = _strided_tile_op(
    "llvm.x86.tileloadd64",
    """tile_load(tile, array, byte_offset, stride): load tile `tile` (a literal) from `array`'s
    data, its first row `byte_offset` bytes in and each next row `stride` bytes on, as many
    rows and bytes per row as the configuration gives the tile.""")
tile_store = _strided_tile_op(
    "llvm.x86.tilestored64",
    """tile_store(tile, array, byte_offset, stride): store tile `tile` (a literal) into
    `array`'s data, laid out as `tile_load` reads.""")


@intrinsic(prefer_literal=True)
def tile_dot_bf16(typingctx, c, a, b):
    """Tile c += tile a . tile b (literals), bfloat16 pairs multiplied and summed in float32
    (TDPBF16PS)."""
    if not (_tile_number(c) and _tile_number(a) and _tile_number(b)):
        return None

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tdpbf16ps", [_I8, _I8, _I8],
              [_I8(t.literal_value) for t in signature.args])
        return context.get_dummy_value()

    return types.void(c, a, b), codegen
