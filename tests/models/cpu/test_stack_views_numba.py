"""The fused decode stack's weight views (stack_views_numba.py) and the kernel's own parts:
its embedding lookup on every weight kind (GGUF blocks, or held as group panels) against the
module path's lookup (bit for bit), a 16-bit weight's linear against quantized_linear's (bit
for bit, GEMV and panels), a projection's bias and Qwen3's per-head q/k norm against the module
path's (bit for bit), and the rotary rows at the step's positions; the lookups raise IndexError
outside their tables. The whole stack against the module path is test_decode.py's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from numba import njit

from mrv2.models.cpu.decode_stack_numba import _add_bias, _head_norm
from mrv2.models.cpu.stack_views_numba import rotary_rows, stack_embed, stack_linear, weight_view
from mrv2.models.layers import half_panel_linear, quantized, quantized_panel_numba
from mrv2.models.layers.norm import RMSNorm
from mrv2.models.layers.quantized import PackedWeight, quantized_linear

VOCAB, WIDTH = 40, 256


@njit
def _lookup(ids, w, out):
    stack_embed(ids, w, out)


@njit
def _stack_linear(x, w, out):
    stack_linear(x, w, out)


@njit
def _biased(out, bias):
    _add_bias(out, bias)


def _values() -> torch.Tensor:
    values = torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(0))
    # float16's subnormals, its largest value and an infinity: every branch of the widening.
    values[3, :4] = torch.tensor([3e-7, -5.9e-8, 65504.0, float("inf")])
    return values


def _half_weights(values: torch.Tensor) -> dict[str, PackedWeight]:
    """The 16-bit weights of `values`, and held as panels where their kernel runs; each made
    with its plan (linear_plan: whether this CPU multiplies the dtype natively, read then)."""
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        out[name] = PackedWeight.from_float(values, dtype)
    if half_panel_linear.panels_run_here():
        for name, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
            out[f"{name} as panels"] = PackedWeight.from_float(values, dtype)
            out[f"{name} as panels"].store_as_panels()
    return out


def _weights() -> dict[str, PackedWeight | torch.Tensor]:
    values = _values()
    out: dict[str, PackedWeight | torch.Tensor] = {"float32": values,
                                                      **_half_weights(values)}
    for gguf_type in ("Q8_0", "Q4_1", "Q5_1"):  # "i8", "u4" with mins, "i8" with mins
        raw = gguf.quants.quantize(values.clamp(-8, 8).numpy(),
                                   gguf.GGMLQuantizationType[gguf_type])
        out[gguf_type] = PackedWeight.from_gguf(raw, gguf_type, (VOCAB, WIDTH))
    # float32 tables (a K-quant's, or a stack list mixing both)
    out["Q4_1 float32 tables"] = out["Q4_1"]._with_float32_tables()
    if quantized_panel_numba.GROUP_PANELS_RUN:  # held as group panels alone, as a model's are
        for gguf_type in ("Q8_0", "Q4_1"):
            raw = gguf.quants.quantize(values.clamp(-8, 8).numpy(),
                                       gguf.GGMLQuantizationType[gguf_type])
            weight = PackedWeight.from_gguf(raw, gguf_type, (VOCAB, WIDTH))
            weight.store_as_panels()
            out[f"{gguf_type} as panels"] = weight
        out["Q4_1 as panels, float32 tables"] = out["Q4_1 as panels"]._with_float32_tables()
    return out


WEIGHTS = _weights()


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_embedding_rows_are_the_module_paths(kind):
    weight = WEIGHTS[kind]
    ids = np.array([3, 0, VOCAB - 1, 3, 17], dtype=np.int32)
    out = np.full((len(ids), WIDTH), np.nan, dtype=np.float32)
    _lookup(ids, weight_view(weight), out)
    if isinstance(weight, torch.Tensor):
        expect = torch.nn.functional.embedding(torch.from_numpy(ids).long(), weight)
    else:  # a weight held as panels against its blocks' rows
        expect = WEIGHTS[kind.split(" as panels")[0]].dequantize_rows(torch.from_numpy(ids))
    assert np.array_equal(out.view(np.int32), expect.numpy().view(np.int32))


@pytest.mark.parametrize("kind", ["float32", "bf16", "Q8_0"])
@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_an_id_outside_the_table_raises(kind, bad):
    out = np.zeros((2, WIDTH), dtype=np.float32)
    with pytest.raises(IndexError):
        _lookup(np.array([1, bad], dtype=np.int32), weight_view(WEIGHTS[kind]), out)


@pytest.mark.parametrize("kind", [k for k in WEIGHTS if k.startswith(("bf16", "f16"))])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_16_bit_linear_is_quantized_linears(kind, rows, monkeypatch):
    """The stack's kernel for a 16-bit projection at each row count is quantized_linear's (the
    panels where the weight takes them or is held as them, else the GEMV), so the stack and the
    layer path agree bit for bit."""
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: False)
    weight = _half_weights(_values())[kind]  # its plan made now: no matrix units
    x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(rows))
    out = np.full((rows, VOCAB), np.nan, dtype=np.float32)
    _stack_linear(x.numpy(), weight_view(weight), out)
    assert np.array_equal(out.view(np.int32), quantized_linear(x, weight).numpy().view(np.int32))


@pytest.mark.parametrize("kind", [k for k in WEIGHTS if k.startswith(("bf16", "f16"))])
def test_16_bit_linear_is_quantized_linears_where_this_cpus_plan_lets_the_stack_run(kind):
    """The weight as made on this CPU (matrix units where it has them): every row count up to
    its plan's `numba_rows` (the rows the stack runs it at) gives quantized_linear's bits."""
    weight = WEIGHTS[kind]
    assert weight.plan.numba_rows >= 1
    for rows in range(1, weight.plan.numba_rows + 1):
        x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(rows))
        out = np.full((rows, VOCAB), np.nan, dtype=np.float32)
        _stack_linear(x.numpy(), weight_view(weight), out)
        expect = quantized_linear(x, weight).numpy()
        assert np.array_equal(out.view(np.int32), expect.view(np.int32)), rows


def test_bias_is_added_as_the_module_path_adds_it():
    """After the product, one float32 add per output (torch's `out + bias`); a [0] bias is
    none."""
    g = torch.Generator().manual_seed(0)
    product, bias = torch.randn(3, 24, generator=g), torch.randn(24, generator=g)
    out = product.numpy().copy()
    _biased(out, bias.numpy())
    assert np.array_equal(out.view(np.int32), (product + bias).numpy().view(np.int32))
    out = product.numpy().copy()
    _biased(out, np.empty(0, dtype=np.float32))
    assert np.array_equal(out, product.numpy())


@pytest.mark.parametrize("rows, num_heads", [(1, 4), (3, 2)])
def test_head_norm_is_the_norm_modules_on_each_head(rows, num_heads):
    """Qwen3's q_norm / k_norm: each head of q (a column slice of the qkv rows, as the stack
    passes it) normalised as the RMSNorm module normalises the heads as rows."""
    head_dim, eps = 32, 1e-6
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, num_heads * head_dim + 40, generator=g)
    norm = RMSNorm(head_dim, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
        q = qkv[:, :num_heads * head_dim]
        expect = norm(q.reshape(-1, head_dim)).reshape(rows, -1)
    out = _head_norm(qkv.numpy()[:, :num_heads * head_dim], norm.weight.detach().numpy(),
                     np.float32(eps), rows, num_heads, head_dim)
    assert np.array_equal(out.view(np.int32), expect.numpy().view(np.int32))


def test_rotary_rows_at_the_positions():
    table = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)
    positions = np.array([5, 0, 11], dtype=np.int64)
    assert np.array_equal(rotary_rows(positions, table), table[positions])
    for bad in (-1, 12):
        with pytest.raises(IndexError):
            rotary_rows(np.array([bad], dtype=np.int64), table)
