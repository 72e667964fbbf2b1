"""stack_moe.py: which MoE declarations and layers the fused decode stack takes (a MoESpec
field it does not compute, a router with a bias, experts split over ranks: not), and the
dense slot of each kind of layer."""

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
    router_bias: bool = False  # a field the stack does not know


def test_supported_declarations():
    spec = _Extended(num_experts=4, top_k=2, intermediate_size=8, renormalize=True,
                     sparse_layers=(True,), shared_intermediate_size=16)
    assert moe_supported(None) and moe_supported(spec)
    assert not moe_supported(dataclasses.replace(spec, router_bias=True))


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
    assert not moe_qualifies(model)
    model = _model()
    model.layers[0].mlp.experts.tp_size = 2
    assert not moe_qualifies(model)
