"""stack_moe.py: which MoE declarations and layers the fused decode stack takes (gpt-oss's
traits; not a MoESpec field it does not compute, an activation or argument it has no kernel
for, a bfloat16 router bias, experts split over ranks), and the dense slot of each layer."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from mrv2.models.cpu.stack_moe import dense_mlp, layer_projection, moe_qualifies, moe_supported
from mrv2.models.decoder_spec import MoESpec
from mrv2.models.layers.mlp import GatedMLP
from mrv2.models.layers.moe import SparseMoE
from mrv2.models.layers.linear import Linear


@dataclasses.dataclass(frozen=True)
class _Extended(MoESpec):
    num_expert_groups: int = 0  # a field the stack does not know (DeepSeek's grouped top-k)


def test_supported_declarations():
    spec = _Extended(num_experts=4, top_k=2, intermediate_size=8, renormalize=True,
                     sparse_layers=(True,), shared_intermediate_size=16)
    assert moe_supported(None) and moe_supported(spec)
    assert not moe_supported(dataclasses.replace(spec, num_expert_groups=2))
    gpt_oss = dataclasses.replace(spec, router_bias=True, expert_bias=True,
                                  activation="swigluoai", activation_kwargs=(("limit", 7.0),))
    assert moe_supported(gpt_oss) and not moe_supported(spec, "gelu")
    assert not moe_supported(dataclasses.replace(gpt_oss, activation_kwargs=(("beta", 1.0),)))


def _model(shared: int = 0):
    block = SparseMoE(16, 4, 2, 8, "silu", True, shared)
    return SimpleNamespace(layers=[SimpleNamespace(mlp=block),
                                   SimpleNamespace(mlp=GatedMLP(16, 24, False, "silu"))])


def test_dense_slots():
    model = _model(shared=12)
    sparse, dense = model.layers
    assert dense_mlp(sparse) is sparse.mlp.shared_expert and dense_mlp(dense) is dense.mlp
    assert layer_projection(sparse, "mlp.down_proj") is sparse.mlp.shared_expert.down_proj
    assert layer_projection(_model().layers[0], "mlp.gate_up_proj") is None


def test_layers_it_does_not_compute():
    assert moe_qualifies(_model()) and moe_qualifies(_model(shared=12))
    model = _model()
    model.layers[0].mlp.gate = Linear(16, 4, bias=True)
    assert moe_qualifies(model)  # gpt-oss's router bias
    model.layers[0].mlp.gate.bias.data = model.layers[0].mlp.gate.bias.data.bfloat16()
    assert not moe_qualifies(model)
    model = _model()
    model.layers[0].mlp.experts.tp_size = 2
    assert not moe_qualifies(model)
