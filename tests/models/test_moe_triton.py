"""moe_triton (the fused MoE's Triton twin) interpreted on CPU tensors: the align step's
invariants (every pair once, the padding sentinel, one expert per block) and fused_moe against
FusedMoE's torch path on the same weights (experts with no tokens, an expert over several
blocks, SiLU and GeLU(tanh), a rank's experts under expert parallelism), and FusedMoE.forward
dispatching to it."""

from __future__ import annotations

import pytest
import torch

from mrv2 import platform
from mrv2.models.layers import moe_triton
from mrv2.models.layers.activation import gelu_tanh_and_mul
from mrv2.models.layers.moe import FusedMoE, route
from tests.models.triton_layer_helpers import INTERPRETED_TOL

HIDDEN, INTER = 32, 16
BLOCKS = (16, 16, 16)  # two N-blocks and two K steps for gate/up (2I = H = 32)


def _experts(num_experts: int, activation: str = "silu", seed: int = 0) -> FusedMoE:
    moe = FusedMoE(num_experts, HIDDEN, INTER, activation)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(moe.gate_up_proj.shape, generator=gen) * 0.3)
        moe.down_proj.copy_(torch.randn(moe.down_proj.shape, generator=gen) * 0.3)
    return moe


def _routed(tokens: int, num_experts: int, top_k: int, seed: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(tokens, num_experts, generator=gen), top_k, True,
                         torch.float32)
    return x, weights, ids


def _check_aligned(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    sorted_pairs, block_experts, num_padded = moe_triton.align_pairs(ids, num_experts, block_m)
    flat = ids.reshape(-1)
    num_pairs, padded = flat.numel(), int(num_padded)
    counts = torch.bincount(flat, minlength=num_experts)
    assert padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_pairs.shape == (block_experts.shape[0] * block_m,)
    valid = sorted_pairs[sorted_pairs != num_pairs].long()
    assert torch.equal(valid.sort().values, torch.arange(num_pairs))  # every pair once
    assert bool((sorted_pairs[padded:] == num_pairs).all())  # past the total: sentinel only
    assert bool((block_experts[padded // block_m:] == -1).all())
    used = block_experts[:padded // block_m].long()
    assert bool((used[1:] >= used[:-1]).all())
    for b, expert in enumerate(used.tolist()):
        block = sorted_pairs[b * block_m:(b + 1) * block_m].long()
        block = block[block != num_pairs]
        assert block.numel() > 0 and bool((flat[block] == expert).all())
        assert bool((block[1:] > block[:-1]).all())
    # Each expert owns ceil(count / block_m) blocks, none for an expert with no pairs.
    blocks_per_expert = torch.bincount(used, minlength=num_experts)
    assert torch.equal(blocks_per_expert, (counts + block_m - 1) // block_m)


@pytest.mark.parametrize("tokens, num_experts, top_k", [(1, 4, 1), (5, 8, 2), (5, 4, 3),
                                                        (40, 4, 2)])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_invariants(tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    _, _, ids = _routed(tokens, num_experts, top_k)
    _check_aligned(ids, num_experts, block_m)


def test_align_known_layout_with_an_expert_without_pairs() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5; expert 3 gets none
    sorted_pairs, block_experts, num_padded = moe_triton.align_pairs(ids, 4, 4)
    s = 6  # the sentinel
    assert sorted_pairs.tolist() == [1, 4, s, s, 3, s, s, s, 0, 2, 5, s] + [s] * 4
    assert block_experts.tolist() == [0, 1, 2, -1]
    assert int(num_padded) == 12
    _check_aligned(ids, 4, 4)


def _interpreted(moe: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 blocks: tuple[int, int, int] | None = BLOCKS) -> torch.Tensor:
    with platform.triton_interpreter(), torch.no_grad():
        return moe_triton.fused_moe(x, moe.gate_up_proj, moe.down_proj, weights, ids,
                                    moe.act_and_mul, blocks)


@pytest.mark.parametrize("tokens, num_experts, top_k", [(1, 4, 1), (1, 8, 3), (5, 8, 2),
                                                        (5, 4, 3)])
def test_fused_moe_matches_torch(tokens: int, num_experts: int, top_k: int) -> None:
    moe = _experts(num_experts)
    x, weights, ids = _routed(tokens, num_experts, top_k)
    out = _interpreted(moe, x, weights, ids)
    assert out.shape == (tokens, HIDDEN) and out.dtype == x.dtype
    with torch.no_grad():
        torch.testing.assert_close(out, moe(x, weights, ids), **INTERPRETED_TOL[torch.float32])


def test_idle_experts_and_an_expert_over_several_blocks() -> None:
    """Experts 0 and 5 get no pairs; expert 1 gets 18 (two M-blocks of 16); GeLU(tanh)."""
    moe = _experts(6, "gelu_pytorch_tanh", seed=3)
    assert moe.act_and_mul is gelu_tanh_and_mul
    x, weights, _ = _routed(18, 6, 2, seed=4)
    ids = torch.stack([torch.ones(18, dtype=torch.int64), torch.arange(18) % 3 + 2], dim=1)
    out = _interpreted(moe, x, weights, ids)
    with torch.no_grad():
        reference = moe(x, weights, ids)
    torch.testing.assert_close(out, reference, **INTERPRETED_TOL[torch.float32])
    # Every token's result reads both of its experts: dropping slot 1 changes it.
    with torch.no_grad():
        only_first = moe(x, weights * torch.tensor([1.0, 0.0]), ids)
    assert bool(((out - only_first).abs().amax(dim=1) > 1e-3).all())


def test_no_tokens_and_one_dtype() -> None:
    moe = _experts(4)
    x, weights, ids = _routed(0, 4, 2)
    assert _interpreted(moe, x, weights, ids).shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="one dtype"):
        moe_triton.fused_moe(x.half(), moe.gate_up_proj, moe.down_proj, weights, ids,
                             moe.act_and_mul)


def test_forward_dispatches_to_triton_on_forced_triton(monkeypatch) -> None:
    """FusedMoE.forward takes the Triton path where the kernels are Triton (CUDA; here the
    interpreter forces it), with the default blocks, and gives the torch path's result."""
    moe = _experts(8)
    x, weights, ids = _routed(5, 8, 2)
    calls = []
    fused = moe_triton.fused_moe
    monkeypatch.setattr(moe_triton, "fused_moe", lambda *a, **k: calls.append(1) or fused(*a))
    with torch.no_grad():
        reference = moe(x, weights, ids)
        assert not calls  # CPU tensors, kernels by device: the torch path
        with platform.triton_interpreter():
            out = moe(x, weights, ids)
    assert calls == [1]
    torch.testing.assert_close(out, reference, **INTERPRETED_TOL[torch.float32])


# Skipped pairs' gate/up rows are never written (torch.empty): the activation of whatever they
# hold may overflow in the interpreter's numpy, and is never read.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_expert_parallel_rank_skips_other_ranks_pairs(monkeypatch) -> None:
    """Rank 1 of 2 holding experts 3..5 of 6 (global ids in, the others' pairs to the
    sentinel expert, never computed, counted 0): FusedMoE's dispatch gives its torch path."""
    from mrv2 import distributed

    monkeypatch.setattr(distributed, "tp_all_reduce", lambda t: t)
    whole = _experts(6, seed=5)
    part = FusedMoE(6, HIDDEN, INTER, "silu", tp_rank=1, tp_size=2, expert_parallel=True)
    with torch.no_grad():
        part.gate_up_proj.copy_(whole.gate_up_proj[3:])
        part.down_proj.copy_(whole.down_proj[3:])
        x, weights, ids = _routed(7, 6, 2, seed=6)
        reference = part(x, weights, ids)
        with platform.triton_interpreter():
            out = part(x, weights, ids)
    torch.testing.assert_close(out, reference, **INTERPRETED_TOL[torch.float32])
    assert bool((ids < 3).any()) and bool(reference.abs().sum() > 0)
