"""mrv2/pipeline.py without processes: how layers split into stages, which checkpoint tensors
a stage loads, and that a stage never runs another's layer (the hand-over between stages runs
end to end in tests/entrypoints/test_pipeline_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mrv2 import distributed
from mrv2.pipeline import MissingLayer, held_by_stage, stage_layers


@pytest.mark.parametrize("num_layers, num_stages, sizes", [
    (4, 1, [4]), (4, 2, [2, 2]), (5, 2, [3, 2]), (5, 3, [2, 2, 1]), (7, 4, [2, 2, 2, 1]),
    (30, 4, [7, 8, 8, 7]), (3, 3, [1, 1, 1]),
])
def test_stages_cover_the_layers_in_order_the_last_gets_no_extra(num_layers, num_stages, sizes):
    stages = [stage_layers(num_layers, s, num_stages) for s in range(num_stages)]
    assert [len(r) for r in stages] == sizes
    assert [layer for r in stages for layer in r] == list(range(num_layers))


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="2 layers cannot fill 3 pipeline stages"):
        stage_layers(2, 0, 3)


class _Stage(nn.Module):
    def __init__(self, held: range, embed: bool, head: bool) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Linear(2, 2) if i in held else MissingLayer()
                                          for i in range(4))
        self.model.embed_tokens = nn.Embedding(3, 2) if embed else None
        self.lm_head = nn.Linear(2, 3) if head else None


def test_a_stage_loads_its_layers_embedding_and_head_only(monkeypatch):
    monkeypatch.setattr(distributed, "_PP_SIZE", 2)
    first, last = _Stage(range(0, 2), True, False), _Stage(range(2, 4), False, True)
    names = ["model.layers.1.mlp.up_proj.weight", "model.layers.2.self_attn.q_proj.weight",
             "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
             "model.layers.9.mlp.up_proj.weight"]
    assert [n for n in names if held_by_stage(first, n)] == [
        names[0], names[2], names[4], names[5]]  # layer 9 is nobody's: the loader refuses it
    assert [n for n in names if held_by_stage(last, n)] == names[1:2] + names[3:]
    monkeypatch.setattr(distributed, "_PP_SIZE", 1)
    assert all(held_by_stage(first, n) for n in names)


def test_a_missing_layer_has_no_parameters_and_is_never_run():
    layer = MissingLayer()
    assert not list(layer.parameters())
    with pytest.raises(RuntimeError, match="another pipeline stage"):
        layer(torch.zeros(1))
