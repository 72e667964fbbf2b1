"""moe_numba.py against moe.py's torch path: routing (the same experts, weights to float32
rounding), the block on float32 experts and on Q8_0 blocks (one view per expert) against
FusedMoE's forward on the same weights, and FusedMoE running its numba twin where it applies.
The whole stack on MoE models against the module path is tests/models/cpu/test_decode.py's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from numba import typed

from mrv2.models.cpu.moe_numba import EXPERTS_SILU, moe_block, route_rows
from mrv2.models.cpu.stack_views_numba import NO_MATRIX, weight_view
from mrv2.models.layers.moe import FusedMoE, route
from mrv2.models.layers.quantized import PackedWeight

HIDDEN, WIDTH = 64, 32


@pytest.mark.parametrize("experts, top_k, renormalize", [(4, 1, True), (8, 3, False),
                                                         (16, 4, True)])
def test_routing_is_the_torch_paths(experts, top_k, renormalize):
    logits = torch.randn(9, experts, generator=torch.Generator().manual_seed(experts))
    weights, ids = np.empty((9, top_k), np.float32), np.empty((9, top_k), np.int64)
    route_rows(logits.numpy(), top_k, renormalize, weights, ids)
    expected_weights, expected_ids = route(logits, top_k, renormalize, torch.float32)
    assert np.array_equal(ids, expected_ids.numpy())
    np.testing.assert_allclose(weights, expected_weights.numpy(), rtol=1e-6)


def _experts(num_experts: int) -> FusedMoE:
    moe = FusedMoE(num_experts, HIDDEN, WIDTH, "silu")
    gen = torch.Generator().manual_seed(num_experts)
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(moe.gate_up_proj.shape, generator=gen) * 0.2)
        moe.down_proj.copy_(torch.randn(moe.down_proj.shape, generator=gen) * 0.2)
    return moe


def _q8_0(weight: torch.Tensor) -> PackedWeight:
    raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    return PackedWeight.from_gguf(raw, "Q8_0", tuple(weight.shape))


@pytest.mark.usefixtures("float_activations")
@pytest.mark.parametrize("on_blocks, rows, top_k", [(False, 1, 2), (True, 5, 3)])
def test_block_is_fused_moes_forward(on_blocks, rows, top_k):
    """Experts gathered, computed on their rows and summed in id order, as FusedMoE does:
    equal to float32 rounding (LLVM may order a dot product's sum differently)."""
    moe = _experts(6)
    if on_blocks:
        moe.set_packed([(_q8_0(moe.gate_up_proj[e]), _q8_0(moe.down_proj[e]))
                        for e in range(6)])
    gen = torch.Generator().manual_seed(rows)
    x, router = torch.randn(rows, HIDDEN, generator=gen), torch.randn(6, HIDDEN, generator=gen)
    pairs = (moe.packed if on_blocks
             else [(moe.gate_up_proj[e], moe.down_proj[e]) for e in range(6)])
    gate_ups, downs = typed.List(), typed.List()
    for gate_up, down in pairs:
        gate_ups.append(weight_view(gate_up))
        downs.append(weight_view(down))
    out = np.empty((rows, HIDDEN), np.float32)
    moe_block(x.numpy(), router.numpy(), NO_MATRIX, gate_ups, downs, NO_MATRIX, NO_MATRIX,
              top_k, True, WIDTH, (EXPERTS_SILU, np.float32(0.0), np.float32(0.0)), out)
    weights, ids = route(x @ router.T, top_k, True, torch.float32)
    np.testing.assert_allclose(out, moe(x, weights, ids).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_fused_moe_runs_its_numba_twin_for_few_rows_in_inference(packed):
    """FusedMoE's forward: NumbaExperts under no_grad for up to MAX_NUMBA_EXPERT_ROWS float32
    rows (rebuilt when a parameter gets new storage), the torch ops otherwise; the same sums."""
    moe = _experts(6)
    if packed:
        moe.set_packed([(_q8_0(moe.gate_up_proj[e]), _q8_0(moe.down_proj[e]))
                        for e in range(6)])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(7, 6, generator=gen), 2, True, torch.float32)
    torch_path = moe(x, weights, ids)
    assert moe._numba is None
    with torch.no_grad():
        numba_path = moe(x, weights, ids)
    assert moe._numba is not None
    torch.testing.assert_close(numba_path, torch_path, rtol=1e-5, atol=1e-5)
    if not packed:
        moe.gate_up_proj.data = moe.gate_up_proj.data * 2
        with torch.no_grad():
            doubled = moe(x, weights, ids)
        torch.testing.assert_close(doubled, moe(x, weights, ids), rtol=1e-5, atol=1e-5)
