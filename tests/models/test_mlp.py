"""The gated MLP block (mrv2/models/layers/mlp.py): long CPU batches in row chunks equal one
pass; with bias-free bfloat16 projections on a CPU that multiplies bfloat16 natively, steps of
at least MIN_NATIVE_HALF_ROWS rows keep bfloat16 between the projections and equal the plain
path bit for bit (the same roundings in the same places); fewer rows take the plain path; a
prompt's rows on projections with int8 copies run on them."""

from __future__ import annotations

import gguf
import pytest
import torch

from mrv2.models.layers import cpu_linear, int8_linear, linear, mlp as mlp_module, quantized
from mrv2.models.layers.linear_plan import MIN_INT8_ROWS, MIN_NATIVE_HALF_ROWS
from mrv2.models.layers.activation import silu_and_mul
from mrv2.models.layers.mlp import GatedMLP, int8_weights, native_bfloat16_weights
from mrv2.models.layers.quantized import PackedWeight

native = pytest.mark.skipif(not quantized.computes_natively(torch.bfloat16),
                            reason="this CPU has no bfloat16 matrix units (or no oneDNN)")


def _mlp(dtype: torch.dtype | None = torch.bfloat16, bias: bool = False,
         hidden: int = 64, intermediate: int = 96) -> GatedMLP:
    """A GatedMLP of seeded weights; with `dtype`, both projections packed in it (as
    quantized_weights.pack_16bit_weights packs a loaded model's)."""
    mlp = GatedMLP(hidden, intermediate, bias=bias, hidden_act="silu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn(2 * intermediate, hidden, generator=g) * 0.2)
        mlp.down_proj.weight.copy_(torch.randn(hidden, intermediate, generator=g) * 0.2)
        if bias:
            mlp.gate_up_proj.bias.copy_(torch.randn(2 * intermediate, generator=g) * 0.1)
            mlp.down_proj.bias.copy_(torch.randn(hidden, generator=g) * 0.1)
    if dtype is not None:
        for module in (mlp.gate_up_proj, mlp.down_proj):
            linear.set_packed(module, PackedWeight.from_float(module.weight, dtype))
    return mlp


def _plain(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """The block's plain path: each projection's own forward, float32 between them."""
    return mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x)))


def _count_native_calls(monkeypatch) -> dict[str, int]:
    calls = {"n": 0}
    real = mlp_module.native_bfloat16_mlp

    def counted(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(mlp_module, "native_bfloat16_mlp", counted)
    return calls


def test_only_silu_is_accepted():
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        GatedMLP(64, 96, bias=False, hidden_act="gelu")


@torch.no_grad()
def test_row_chunks_equal_one_pass(monkeypatch):
    """A long CPU batch runs in chunks of chunk_rows rows; the result is the one-pass
    result."""
    mlp = _mlp(dtype=None, hidden=32, intermediate=48)
    x = torch.randn(300, 32, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(mlp_module, "CHUNK_BYTES", 8 * 48 * 128)  # 128-row chunks
    assert mlp_module.chunk_rows(48) == 128
    passes = []
    real = GatedMLP.forward_rows

    def spy(self, rows):
        passes.append(rows.shape[0])
        return real(self, rows)

    monkeypatch.setattr(GatedMLP, "forward_rows", spy)
    chunked = mlp(x)
    assert passes == [128, 128, 44]
    monkeypatch.setattr(GatedMLP, "forward_rows", real)
    torch.testing.assert_close(chunked, mlp.forward_rows(x), rtol=1e-6, atol=1e-6)


def test_chunks_keep_the_last_level_cache_budget():
    """A chunk's [rows, 2I] float32 intermediate stays within CHUNK_BYTES, with at least 128
    rows however wide the MLP."""
    for intermediate in (48, 1536, 8192, 1 << 20):
        rows = mlp_module.chunk_rows(intermediate)
        assert rows >= 128
        assert rows == 128 or rows * 8 * intermediate <= mlp_module.CHUNK_BYTES


@native
@pytest.mark.parametrize("rows", [MIN_NATIVE_HALF_ROWS, 33])
@torch.no_grad()
def test_native_bfloat16_path_equals_the_plain_path_bit_for_bit(rows, monkeypatch):
    mlp = _mlp()
    calls = _count_native_calls(monkeypatch)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    out = mlp.forward_rows(x)
    assert calls["n"] == 1  # the bfloat16-between-projections path ran
    assert torch.equal(out, _plain(mlp, x))


@native
@torch.no_grad()
def test_few_rows_take_the_plain_path(monkeypatch):
    mlp = _mlp()
    calls = _count_native_calls(monkeypatch)
    for kernel in ("onednn_linear", "native_16bit_linear", "half_linear"):
        monkeypatch.setattr(cpu_linear, kernel, None)  # the GEMV path calls no matrix unit
    x = torch.randn(MIN_NATIVE_HALF_ROWS - 1, 64)
    out = mlp(x)
    assert calls["n"] == 0
    assert torch.equal(out, _plain(mlp, x))


def test_only_bias_free_bfloat16_projections_on_a_native_cpu_qualify(monkeypatch):
    """From MIN_NATIVE_HALF_ROWS rows, where both weights' plans (made with the weights, on
    whether this CPU multiplies bfloat16 natively) run those rows on the matrix units."""
    rows = MIN_NATIVE_HALF_ROWS
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: True)
    weights = native_bfloat16_weights(_mlp(), rows)
    assert weights is not None
    assert weights[0].half_dtype == weights[1].half_dtype == torch.bfloat16
    assert native_bfloat16_weights(_mlp(), rows - 1) is None  # the GEMV's rows
    assert native_bfloat16_weights(_mlp(torch.float16), rows) is None
    assert native_bfloat16_weights(_mlp(bias=True), rows) is None
    assert native_bfloat16_weights(_mlp(dtype=None), rows) is None  # float32 weights
    one_packed = _mlp(dtype=None)
    linear.set_packed(one_packed.gate_up_proj, PackedWeight.from_float(
        one_packed.gate_up_proj.weight, torch.bfloat16))
    assert native_bfloat16_weights(one_packed, rows) is None  # down still float32
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: False)
    assert native_bfloat16_weights(_mlp(), rows) is None


@native
def test_a_bfloat16_model_has_every_layers_mlp_qualify(tiny_llama):
    """dtype="bfloat16" through the engine's config and cpu.prepare: every layer's MLP runs
    bfloat16 between its projections."""
    from mrv2.engine.arg_utils import EngineArgs
    from mrv2.models import cpu, load_model

    config = EngineArgs(model=str(tiny_llama), dtype="bfloat16",
                        device="cpu").create_engine_config().model_config
    model = load_model(config, torch.device("cpu"))
    cpu.prepare(model, config)
    layers = list(model.model.layers)
    assert layers and all(native_bfloat16_weights(layer.mlp, MIN_NATIVE_HALF_ROWS) is not None
                          for layer in layers)


@pytest.mark.skipif(not int8_linear.int8_products_run(), reason="oneDNN has no VNNI int8 here")
@torch.no_grad()
def test_a_prompts_rows_run_both_projections_on_their_int8_copies():
    """Projections of Q8_0 blocks beside bfloat16 and int8 copies (a default GGUF model's on
    a VNNI CPU): from MIN_INT8_ROWS rows the block is `int8_mlp` of the int8 copies (near the
    float32 block); below, bfloat16 between the projections as before."""
    mlp = _mlp(dtype=None)
    for module in (mlp.gate_up_proj, mlp.down_proj):
        n, k = module.weight.shape
        raw = gguf.quants.quantize(module.weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
        weight = PackedWeight.from_gguf(raw, "Q8_0", (n, k))
        weight.hold_bf16_copy()
        weight.hold_int8_copy()
        linear.set_packed(module, weight)
    rows = MIN_INT8_ROWS
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(5))
    int8 = int8_weights(mlp, rows)
    assert int8 == (mlp.gate_up_proj.packed.int8_copy, mlp.down_proj.packed.int8_copy)
    assert int8_weights(mlp, rows - 1) is None and native_bfloat16_weights(mlp, rows) is None
    out = mlp.forward_rows(x)
    assert torch.equal(out, mlp_module.int8_mlp(x, *int8))
    exact = _mlp(dtype=None).forward_rows(x)
    assert (out - exact).abs().max() <= 0.03 * exact.abs().max()
