"""The Llama MLP kept in bfloat16 between its linears on the CPU's matrix units, against the
layer path's own forward (the same roundings: equal bit for bit)."""

from __future__ import annotations

import pytest
import torch

from mrv2.models import llama
from mrv2.models.cpu import mlp_chunks, native_half_mlp
from mrv2.models.cpu.quantized_weights import QuantizedLinearForward
from mrv2.models.layers import cpu_linear, quantized
from mrv2.models.layers.quantized import QuantizedWeight

native = pytest.mark.skipif(not quantized.computes_natively(torch.bfloat16),
                            reason="this CPU has no bfloat16 matrix units (or no oneDNN)")


def _mlp(dtype: torch.dtype = torch.bfloat16, bias: bool = False) -> llama.LlamaMLP:
    mlp = llama.LlamaMLP(64, 96, bias=bias, hidden_act="silu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn(192, 64, generator=g) * 0.2)
        mlp.down_proj.weight.copy_(torch.randn(64, 96, generator=g) * 0.2)
    for module in (mlp.gate_up_proj, mlp.down_proj):  # as quantized_weights attaches them
        module.forward = QuantizedLinearForward(module,
                                                QuantizedWeight.from_float(module.weight, dtype))
    return mlp


@native
@pytest.mark.parametrize("rows", [quantized.MIN_NATIVE_HALF_ROWS, 33])
@torch.no_grad()
def test_equals_the_layer_path_bit_for_bit(rows):
    mlp = _mlp()
    own = mlp_chunks.own_forward(mlp)
    fused = native_half_mlp.native_half_mlp(mlp, own)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(fused(x), own(x))


@native
@torch.no_grad()
def test_few_rows_run_the_own_forward(monkeypatch):
    mlp = _mlp()
    own = mlp_chunks.own_forward(mlp)
    fused = native_half_mlp.native_half_mlp(mlp, own)
    monkeypatch.setattr(cpu_linear, "onednn_linear", None)  # the GEMV path must not call it
    x = torch.randn(quantized.MIN_NATIVE_HALF_ROWS - 1, 64)
    assert torch.equal(fused(x), own(x))


def test_only_bfloat16_projections_without_bias_on_a_native_cpu(monkeypatch):
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: True)
    own = mlp_chunks.own_forward
    assert native_half_mlp.native_half_mlp(_mlp(), own(_mlp())) is not None
    assert native_half_mlp.native_half_mlp(_mlp(torch.float16), None) is None
    assert native_half_mlp.native_half_mlp(_mlp(bias=True), None) is None
    plain = llama.LlamaMLP(64, 96, bias=False, hidden_act="silu")  # float32 weights
    assert native_half_mlp.native_half_mlp(plain, own(plain)) is None
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: False)
    assert native_half_mlp.native_half_mlp(_mlp(), own(_mlp())) is None


@native
@torch.no_grad()
def test_attach_gives_a_bfloat16_model_the_fused_mlp(tiny_llama):
    from mrv2.engine.arg_utils import EngineArgs
    from mrv2.models import cpu, load_model

    config = EngineArgs(model=str(tiny_llama), dtype="bfloat16",
                        device="cpu").create_engine_config().model_config
    model = load_model(config, torch.device("cpu"))
    paths = cpu.attach(model, config)
    assert all(isinstance(m.forward, native_half_mlp.NativeHalfMLP) for m in paths.mlps)
