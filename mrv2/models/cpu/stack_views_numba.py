"""The fused decode stack's views of weights (decode_stack_numba.py): a float32 weight, a
16-bit weight (`HalfWeightView`) or GGUF blocks (`BlockWeightView`), and the two things the
stack does with one: `stack_linear` (out = x @ W^T) and `stack_embed` (rows of a table), each
picking its kernel at compile time from the view's class and at run time from whether the view
has panels (and blocks), as quantized_linear does; and the rotary tables' rows at a step's
positions. The same arithmetic as the module path's kernels (cpu_gemv, quantized_numba,
dense_gemv_numba, half_panel_linear, quantized_panel_numba)."""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import torch
from numba import njit, typed, types
from numba.extending import overload

from mrv2.models.layers.cpu_gemv import gemv_kernel
from mrv2.models.layers.half_panel_linear import PANEL_OUTPUTS, half_panel_kernel
from mrv2.models.layers.numba_rows import typed_list
from mrv2.models.layers.quantized import PackedWeight
from mrv2.models.layers.dense_gemv_numba import gemv_half, gemv_half_pairs
from mrv2.models.layers.quantized_numba import dequant_rows_serial, gemv_groups
from mrv2.models.layers.quantized_panel_layout import no_group_panels, panel_rows
from mrv2.models.layers.quantized_panel_numba import GROUP_PANELS_RUN, group_panel_kernel
from mrv2.models.layers.vector_ir import bf16_bits_to_float, f16_bits_to_float
from mrv2.utils.kernel_flags import FASTMATH


class HalfWeightView(NamedTuple):
    """A 16-bit weight as the stack reads it."""
    q: np.ndarray  # int16 bit patterns [N, K]; [N, 0] where the weight is held as its panels
    bf16: bool  # else float16
    panels: np.ndarray  # half_panel_linear's, run at every row count; [0, K, 64]: none
    pairs_from: int  # rows of x from which gemv_half_pairs runs (LinearPlan.pairs_from)


class BlockWeightView(NamedTuple):
    """GGUF blocks as the stack reads them (quantized.PackedWeight's layout)."""
    q: np.ndarray  # the values as bytes [N, ...]; [N, 0] where held as the group panels
    scales: np.ndarray
    mins: np.ndarray  # [N, 0]: no min term
    u4: bool  # values are 4-bit nibbles (else int8)
    group_size: int
    x_format: int  # linear_plan.GEMV_X_FORMAT: how the GEMV rounds x
    panels: tuple  # quantized_panel_numba's (weights, scales, mins); an empty one: none


def weight_view(weight: PackedWeight | torch.Tensor, float32_tables: bool = False,
                 linear: bool = True):
    """The kernel's view of one weight: a float32 weight as is, a 16-bit weight as a
    HalfWeightView, GGUF blocks as a BlockWeightView (x format: its plan's). Panels: the
    weight's where it is held as them or its plan runs them and it serves as a `linear`, else
    none. With `float32_tables`, float32 copies of float16 scale / min tables."""
    if isinstance(weight, torch.Tensor):
        return weight.detach().numpy()
    if weight.is_half:
        takes_panels = weight.panel_storage or (linear and weight.plan.on_panels)
        panels = weight.panels() if takes_panels else np.empty((0, 0, PANEL_OUTPUTS), np.int16)
        return HalfWeightView(weight.q.numpy(), weight.layout == "bf16", panels,
                              weight.plan.pairs_from)
    if float32_tables:
        weight = weight._with_float32_tables()
    takes_panels = weight.panel_storage or (linear and weight.plan.on_panels)
    panels = (weight.group_panels() if takes_panels
              else no_group_panels(weight.scales.numpy().dtype))
    return BlockWeightView(weight.q.view(torch.uint8).numpy(), weight.scales.numpy(),
                           weight.kernel_mins.numpy(), weight.layout == "u4", weight.group_size,
                           weight.plan.x_format, panels)


# An absent float32 matrix (a dense layer's router, a weight no layer has), as kernels take it.
NO_MATRIX = np.empty((0, 0), np.float32)


def no_rows(view):
    """A view of the same numba type as `view` (a float32 weight, HalfWeightView or
    BlockWeightView) with no output rows: the stack's placeholder for a weight a layer does
    not have (a typed list's items share one type)."""
    if isinstance(view, np.ndarray):
        return view[:0]
    if isinstance(view, HalfWeightView):
        return view._replace(q=view.q[:0], panels=view.panels[:0])
    return view._replace(q=view.q[:0], scales=view.scales[:0], mins=view.mins[:0],
                         panels=tuple(p[:0] for p in view.panels))


def projection_view(module, float32_tables: bool = False):
    """The kernel's view of one projection (`weight_view`): the GGUF blocks or 16-bit weight
    it is packed as, else its float32 weight."""
    weight = module.packed
    return weight_view(module.weight if weight is None else weight, float32_tables)


def projection_views(modules, like=None) -> typed.List:
    """One projection of every layer as a typed list: its items must share one numba type, so
    where the layers' table dtypes differ (a file mixing K-quants and 32-input types) every
    one gets float32 tables; a layer without it (None: a MoE layer's MLP) a placeholder
    (`like`: a view whose type it takes when no layer has one)."""
    views = [None if m is None else projection_view(m) for m in modules]
    if len({numba.typeof(v) for v in views if v is not None}) > 1:
        views = [None if m is None else projection_view(m, float32_tables=True)
                 for m in modules]
    present = [v for v in views if v is not None]
    # A layer without one: a placeholder of the others' type, else of `like`'s (a view of
    # another projection: the same compiled stack as a model with those weights everywhere).
    placeholder = no_rows(present[0] if present else like)
    return typed_list(tuple(placeholder if v is None else v for v in views))


def stack_linear(x, w, out):
    """out = x @ W^T inside the stack; `w` a float32 weight view, a HalfWeightView or a
    BlockWeightView (numba only: see the overload)."""
    raise NotImplementedError("compiled into the decode stack only")


def _view_kind(w) -> type | None:
    """The view class of a numba type (a HalfWeightView or BlockWeightView), else None."""
    return w.instance_class if isinstance(w, types.BaseNamedTuple) else None


@overload(stack_linear, jit_options={"fastmath": FASTMATH})
def _stack_linear_overload(x, w, out):
    if isinstance(w, types.NoneType):  # no LM head in the stack
        return lambda x, w, out: None
    if isinstance(w, types.Array):
        return lambda x, w, out: gemv_kernel(x, w, out)
    if _view_kind(w) is HalfWeightView:
        def half(x, w, out):
            if w.panels.shape[0] > 0:  # as quantized_linear
                half_panel_kernel(x, w.panels, w.bf16, out)
            elif x.shape[0] >= w.pairs_from:
                gemv_half_pairs(x, w.q, w.bf16, out)
            else:
                gemv_half(x, w.q, w.bf16, out)
        return half
    if _view_kind(w) is not BlockWeightView:
        raise TypeError(f"the decode stack has no linear for a {w} weight view")

    if not GROUP_PANELS_RUN:
        # The panels' kernel is AVX-512 code: where it does not run, no view has panels, and
        # it must not be compiled at all (LLVM cannot lower its 512-bit intrinsics for AVX2).
        return lambda x, w, out: gemv_groups(x, w.q, w.scales, w.mins, w.u4, w.group_size,
                                             w.x_format, out)

    def blocks(x, w, out):
        if w.panels[0].shape[0] > 0:  # as quantized_linear, for every row count
            group_panel_kernel(x, w.panels[0], w.panels[1], w.panels[2], w.u4, out)
        else:
            gemv_groups(x, w.q, w.scales, w.mins, w.u4, w.group_size, w.x_format, out)
    return blocks


def stack_embed(ids, w, out):
    """out[i] = row ids[i] of the embedding `w` (a float32 table, a HalfWeightView or a
    BlockWeightView, as `stack_linear` takes them), widened or
    dequantized exactly as the module path's lookup does; an id outside the table raises
    IndexError (numba only: see the overload)."""
    raise NotImplementedError("compiled into the decode stack only")


@njit(cache=True)
def _check_ids(ids, vocab_rows):
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= vocab_rows:
            raise IndexError("a token id outside the embedding table")


@overload(stack_embed, jit_options={"fastmath": FASTMATH})
def _stack_embed_overload(ids, w, out):
    if isinstance(w, types.Array):
        def table_rows(ids, w, out):
            _check_ids(ids, w.shape[0])
            for i in range(ids.shape[0]):
                out[i] = w[ids[i]]
        return table_rows
    if _view_kind(w) is HalfWeightView:
        def half_rows(ids, w, out):
            q, bf16, panels = w.q, w.bf16, w.panels
            _check_ids(ids, q.shape[0])
            for i in range(ids.shape[0]):
                for j in range(out.shape[1]):
                    if q.shape[1] == 0:  # held as its panels alone: input j, lane o
                        bits = panels[ids[i] // PANEL_OUTPUTS, j, ids[i] % PANEL_OUTPUTS]
                    else:
                        bits = q[ids[i], j]
                    out[i, j] = bf16_bits_to_float(bits) if bf16 else f16_bits_to_float(bits)
        return half_rows
    if _view_kind(w) is not BlockWeightView:
        raise TypeError(f"the decode stack has no lookup for a {w} embedding view")

    def block_rows(ids, w, out):
        q, scales, mins, u4, group_size = w.q, w.scales, w.mins, w.u4, w.group_size
        _check_ids(ids, q.shape[0])
        if q.shape[1] == 0:  # held as its group panels alone
            panel_rows(w.panels[0], w.panels[1], w.panels[2], u4, ids, out)
        elif u4:
            dequant_rows_serial(q, scales, mins, True, group_size, ids, out)
        else:  # the view's q is bytes; "i8" values are signed
            dequant_rows_serial(q.view(np.int8), scales, mins, False, group_size, ids, out)
    return block_rows


@njit(cache=True)
def rotary_rows(positions, table):
    """The rows of a rotary table (cos or sin, [max_position, head_dim]) at `positions`, as
    the module path's `get_cos_sin` gathers them; a position outside raises IndexError."""
    out = np.empty((positions.shape[0], table.shape[1]), dtype=np.float32)
    for i in range(positions.shape[0]):
        if positions[i] < 0 or positions[i] >= table.shape[0]:
            raise IndexError("a position outside the rotary tables")
        out[i] = table[positions[i]]
    return out
