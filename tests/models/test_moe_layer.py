"""mrv2.models.layers.moe: routing as transformers routes, the grouped experts against a
token-by-token reference, per-expert and whole 3-D checkpoint tensors loading the same
parameters, each tensor-parallel rank its slice of every expert (or, under expert parallelism,
its whole experts, the ranks' outputs summing to one rank's), and the checkpoint names of
per-expert tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2.models.layers.moe import FusedMoE, SparseMoE, expert_range, expert_shard, route


def _experts(num_experts: int, hidden: int, inter: int, seed: int = 0, **kwargs) -> FusedMoE:
    moe = FusedMoE(num_experts, hidden, inter, "silu", **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(moe.gate_up_proj.shape, generator=gen) * 0.3)
        moe.down_proj.copy_(torch.randn(moe.down_proj.shape, generator=gen) * 0.3)
    return moe


def _token_by_token(moe: FusedMoE, x: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    inter = moe.local_intermediate
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate_up = moe.gate_up_proj[e] @ x[t]
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, slot] * (moe.down_proj[e] @ h)
    return out


@pytest.mark.parametrize("num_experts, top_k, renormalize", [(4, 1, True), (8, 2, True),
                                                             (16, 4, False), (6, 3, False)])
def test_route_is_softmax_top_k_renormalised(num_experts, top_k, renormalize):
    logits = torch.randn(7, num_experts, generator=torch.Generator().manual_seed(num_experts))
    weights, ids = route(logits, top_k, renormalize, torch.float32)
    probs = logits.softmax(-1)
    assert torch.equal(ids, probs.topk(top_k, -1).indices)
    expected = probs.gather(1, ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
        assert torch.allclose(weights.sum(-1), torch.ones(7))
    torch.testing.assert_close(weights, expected)


@pytest.mark.parametrize("num_experts, top_k, tokens", [(4, 1, 1), (8, 2, 5), (16, 4, 33)])
def test_grouped_experts_equal_the_token_by_token_sum(num_experts, top_k, tokens):
    moe = _experts(num_experts, 24, 40)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 24, generator=gen)
    weights, ids = route(torch.randn(tokens, num_experts, generator=gen), top_k, True,
                         torch.float32)
    torch.testing.assert_close(moe(x, weights, ids), _token_by_token(moe, x, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_per_expert_and_whole_tensors_load_the_same_and_ranks_hold_their_slices():
    num_experts, hidden, inter = 3, 8, 12
    gen = torch.Generator().manual_seed(2)
    gate = torch.randn(num_experts, inter, hidden, generator=gen)
    up = torch.randn(num_experts, inter, hidden, generator=gen)
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    whole = FusedMoE(num_experts, hidden, inter, "silu", tp_rank=0, tp_size=1)
    whole.weight_loader(whole.gate_up_proj, torch.cat([gate, up], dim=1))
    whole.weight_loader(whole.down_proj, down)
    for rank in range(2):
        part = FusedMoE(num_experts, hidden, inter, "silu", tp_rank=rank, tp_size=2)
        for e in range(num_experts):
            part.weight_loader(part.gate_up_proj, gate[e], (e, 0))
            part.weight_loader(part.gate_up_proj, up[e], (e, 1))
            part.weight_loader(part.down_proj, down[e], (e, None))
        rows = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(part.gate_up_proj, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(part.down_proj, down[:, :, rows])
    assert torch.equal(whole.gate_up_proj, torch.cat([gate, up], dim=1))
    with pytest.raises(ValueError, match="expert 5: the layer has 3 experts"):
        whole.weight_loader(whole.down_proj, down[0], (5, None))
    with pytest.raises(ValueError, match="expected"):
        whole.weight_loader(whole.down_proj, down[:, :, :4])


def test_expert_checkpoint_names():
    assert expert_shard("model.layers.2.mlp.experts.11.up_proj.weight") == (
        "model.layers.2.mlp.experts.gate_up_proj", (11, 1))
    assert expert_shard("model.layers.0.mlp.experts.0.down_proj.weight") == (
        "model.layers.0.mlp.experts.down_proj", (0, None))
    assert expert_shard("model.layers.0.mlp.shared_expert.up_proj.weight") is None
    assert expert_shard("model.layers.0.mlp.gate_up_proj.weight") is None


def test_shared_expert_joins_behind_its_sigmoid_gate():
    block = SparseMoE(16, 4, 2, 8, "silu", True, shared_intermediate_size=12)
    gen = torch.Generator().manual_seed(4)
    for p in block.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(5, 16, generator=gen)
    weights, ids = route(block.gate(x), 2, True, x.dtype)
    expected = (block.experts(x, weights, ids)
                + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x))
    torch.testing.assert_close(block(x), expected)
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        SparseMoE(16, 4, 5, 8, "silu", True)


def test_packed_experts_compute_what_their_rounded_weights_do():
    """Experts on 16-bit packed weights (as a bfloat16 model's, models/cpu/quantized_weights)
    give what the float experts give on the same rounded weights; the float parameters go."""
    from mrv2.models.layers.quantized import PackedWeight

    moe = _experts(8, 32, 48, seed=5)
    with torch.no_grad():  # the weights bfloat16 holds, so both sides compute on the same
        moe.gate_up_proj.copy_(moe.gate_up_proj.bfloat16().float())
        moe.down_proj.copy_(moe.down_proj.bfloat16().float())
    gen = torch.Generator().manual_seed(6)
    # One row an expert: the 16-bit GEMV keeps x in float32 (from MIN_NATIVE_HALF_ROWS rows
    # the matrix units round it to bfloat16, tested in tests/models/test_quantized.py).
    x = torch.randn(1, 32, generator=gen)
    weights, ids = route(torch.randn(1, 8, generator=gen), 3, True, torch.float32)
    expected = moe(x, weights, ids)
    moe.set_packed([(PackedWeight.from_float(moe.gate_up_proj[e], torch.bfloat16),
                     PackedWeight.from_float(moe.down_proj[e], torch.bfloat16))
                    for e in range(8)])
    assert moe.gate_up_proj.numel() == 0 and moe.down_proj.numel() == 0
    torch.testing.assert_close(moe(x, weights, ids), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed experts: 2 for 8 experts"):
        moe.set_packed(list(moe.packed[:2]))


def _gpt_oss_block(tp_rank: int = 0, tp_size: int = 1, limit: float = 0.8, **options):
    """transformers' GptOssMLP (random weights, biases included) and a SparseMoE declared as
    gpt-oss's, the reference's tensors loaded as a checkpoint holds them."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=5,
                          num_experts_per_tok=2, swiglu_limit=limit)
    ref = GptOssMLP(config).float()
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    block = SparseMoE(16, 5, 2, 12, "silu", True, router_bias=True,
                      expert_activation="swigluoai", bias=True,
                      activation_kwargs=(("alpha", 1.702), ("limit", limit)),
                      checkpoint_layout="interleaved_transposed", tp_rank=tp_rank,
                      tp_size=tp_size, **options)
    params = dict(block.named_parameters())
    for name, tensor in ref.state_dict().items():
        param = params[name.replace("router.", "gate.")]
        loader = getattr(param, "weight_loader", None)
        if loader is None:  # the router: replicated
            param.data.copy_(tensor)
        else:
            loader(param, tensor)
    return ref, block


def test_gpt_oss_block_matches_transformers():
    """Router bias, top-k then softmax, interleaved and transposed gate/up de-interleaved at
    load, expert biases and the clamped SwiGLU (its limit low enough to bite) against
    transformers' GptOssMLP."""
    ref, block = _gpt_oss_block()
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected, _ = ref(x)
        torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)
        gate_up = F.linear(x[0], block.experts.gate_up_proj[0], block.experts.gate_up_proj_bias[0])
    assert (gate_up[:, :12] > 0.8).any() and (gate_up[:, 12:].abs() > 0.8).any()


def test_gpt_oss_ranks_hold_their_slices_and_add_down_bias_once(monkeypatch):
    """Under tp 2 each rank holds its half of gate's and up's rows and biases; down's bias is
    added by rank 0 only, so the ranks' partial sums (all-reduced: summed here) are tp 1's."""
    from mrv2 import distributed

    monkeypatch.setattr(distributed, "tp_all_reduce", lambda t: t)
    ref, whole = _gpt_oss_block()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(10))
    weights, ids = route(whole.gate(x), 2, True, x.dtype)
    parts = [_gpt_oss_block(rank, 2)[1] for rank in range(2)]
    for rank, part in enumerate(parts):
        rows = torch.cat([torch.arange(6) + rank * 6, torch.arange(6) + 12 + rank * 6])
        assert torch.equal(part.experts.gate_up_proj, whole.experts.gate_up_proj[:, rows])
        assert torch.equal(part.experts.gate_up_proj_bias,
                           whole.experts.gate_up_proj_bias[:, rows])
    with torch.no_grad():
        torch.testing.assert_close(sum(p.experts(x, weights, ids) for p in parts),
                                   whole.experts(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_expert_range_is_vllms_linear_placement():
    """Contiguous runs, the first E % tp ranks one expert more (determine_expert_map)."""
    assert [expert_range(8, r, 2) for r in range(2)] == [(0, 4), (4, 4)]
    assert [expert_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 2)]
    assert [expert_range(3, r, 4) for r in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 0)]
    assert not FusedMoE(4, 8, 6, "silu", tp_rank=0, tp_size=1,
                        expert_parallel=True).expert_parallel  # tp 1: a no-op


def test_expert_parallel_ranks_load_their_whole_experts_from_each_layout(tmp_path):
    """5 experts over 2 ranks (3 and 2): a rank's experts, whole, from per-expert tensors
    (other ranks' skipped), from whole 3-D tensors and from a lazy safetensors slice."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    num_experts, hidden, inter = 5, 8, 6
    gen = torch.Generator().manual_seed(11)
    gate, up = (torch.randn(num_experts, inter, hidden, generator=gen) for _ in range(2))
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    gate_up = torch.cat([gate, up], dim=1)
    save_file({"gate_up": gate_up, "down": down}, str(tmp_path / "experts.safetensors"))
    for rank, (start, count) in enumerate([(0, 3), (3, 2)]):
        layers = [FusedMoE(num_experts, hidden, inter, "silu", tp_rank=rank, tp_size=2,
                           expert_parallel=True) for _ in range(3)]
        for e in range(num_experts):
            layers[0].weight_loader(layers[0].gate_up_proj, gate[e], (e, 0))
            layers[0].weight_loader(layers[0].gate_up_proj, up[e], (e, 1))
            layers[0].weight_loader(layers[0].down_proj, down[e], (e, None))
        layers[1].weight_loader(layers[1].gate_up_proj, gate_up)
        layers[1].weight_loader(layers[1].down_proj, down)
        with safe_open(str(tmp_path / "experts.safetensors"), framework="pt") as f:
            layers[2].weight_loader(layers[2].gate_up_proj, f.get_slice("gate_up"))
            layers[2].weight_loader(layers[2].down_proj, f.get_slice("down"))
        for layer in layers:
            assert (layer.expert_start, layer.num_local_experts) == (start, count)
            assert torch.equal(layer.gate_up_proj, gate_up[start:start + count])
            assert torch.equal(layer.down_proj, down[start:start + count])
    with pytest.raises(ValueError, match="expected 5 experts"):
        layers[1].weight_loader(layers[1].down_proj, down[:4])


@pytest.mark.parametrize("tp", [2, 3])
def test_expert_parallel_ranks_sum_to_the_whole_block(monkeypatch, tp):
    """Each rank computes only its experts' pairs for every token (global ids mapped to its
    own, the rest dropped); the ranks' outputs (all-reduced: summed here) are tp 1's."""
    from mrv2 import distributed

    monkeypatch.setattr(distributed, "tp_all_reduce", lambda t: t)
    whole = _experts(5, 16, 12, seed=12)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(9, 16, generator=gen)
    weights, ids = route(torch.randn(9, 5, generator=gen), 2, True, torch.float32)
    parts = []
    for rank in range(tp):
        part = FusedMoE(5, 16, 12, "silu", tp_rank=rank, tp_size=tp, expert_parallel=True)
        part.weight_loader(part.gate_up_proj, whole.gate_up_proj.detach())
        part.weight_loader(part.down_proj, whole.down_proj.detach())
        parts.append(part(x, weights, ids))
    assert all(bool(p.abs().sum() > 0) for p in parts)  # every rank's experts were routed to
    torch.testing.assert_close(sum(parts), whole(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_gpt_oss_expert_parallel_ranks_add_their_experts_down_bias(monkeypatch):
    """gpt-oss under expert parallelism: each rank holds its experts' biases whole (gate/up's
    de-interleaved) and adds down's bias for its own pairs, so the ranks' sum is tp 1's."""
    from mrv2 import distributed

    monkeypatch.setattr(distributed, "tp_all_reduce", lambda t: t)
    _, whole = _gpt_oss_block()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(14))
    parts = [_gpt_oss_block(rank, 2, expert_parallel=True)[1] for rank in range(2)]
    for part, experts in zip(parts, (slice(0, 3), slice(3, 5))):
        assert torch.equal(part.experts.gate_up_proj_bias,
                           whole.experts.gate_up_proj_bias[experts])
        assert torch.equal(part.experts.down_proj_bias, whole.experts.down_proj_bias[experts])
    with torch.no_grad():
        torch.testing.assert_close(sum(p(x) for p in parts), whole(x), rtol=1e-5, atol=1e-5)
