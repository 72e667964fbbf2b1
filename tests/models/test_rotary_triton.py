"""rotary_triton (q and k in one launch, optional per-head RMSNorm first) against rotary.py's
torch path: interpreted on CPU tensors, q and k as views of a fused qkv output (odd head
counts, GQA), compiled on a GPU in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from mrv2 import platform
from mrv2.models.layers import rotary_triton
from mrv2.models.layers.norm import RMSNorm
from mrv2.models.layers.rotary import RotaryEmbedding, apply_rotary_qk
from tests.models.triton_layer_helpers import (COMPILED_TOL, INTERPRETED_TOL, compiled_variants,
                                               needs_cuda)

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
ROTARY_DYNAMIC = ("num_q_heads", "num_k_heads")


def _case(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
          device: str, qk_norm: bool):
    """q, k as the model passes them (column views of one qkv [T, (H + 2KV) * D]), cos/sin of
    random positions, and the Qwen3 norms when `qk_norm`."""
    gen = torch.Generator().manual_seed(tokens * 100 + heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, :heads * head_dim]
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim]
    rotary = RotaryEmbedding(head_dim, 64, ROPE).to(device)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(device)
    cos, sin = rotary.get_cos_sin(positions, dtype)
    norms = (None, None)
    if qk_norm:
        norms = tuple(RMSNorm(head_dim, 1e-6).to(device) for _ in range(2))
        for norm in norms:
            norm.weight.data = (torch.rand(head_dim, generator=gen) + 0.5).to(device, dtype)
    return q, k, cos, sin, norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "norm+rotary"])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 2, 1, 8), (3, 3, 1, 12)])
@torch.no_grad()
def test_interpreted_matches_torch(tokens: int, heads: int, kv_heads: int, head_dim: int,
                                   qk_norm: bool, dtype: torch.dtype) -> None:
    q, k, cos, sin, norms = _case(tokens, heads, kv_heads, head_dim, dtype, "cpu", qk_norm)
    ref_q, ref_k = apply_rotary_qk(q, k, cos, sin, head_dim, *norms)
    with platform.triton_interpreter():
        out_q, out_k = apply_rotary_qk(q, k, cos, sin, head_dim, *norms)
    assert out_q.dtype == out_k.dtype == dtype
    torch.testing.assert_close(out_q, ref_q, **INTERPRETED_TOL[dtype])
    torch.testing.assert_close(out_k, ref_k, **INTERPRETED_TOL[dtype])


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "norm+rotary"])
@torch.no_grad()
def test_compiled_matches_torch(qk_norm: bool, dtype: torch.dtype) -> None:
    for tokens in (1, 7, 33, 256):
        # Qwen3-0.6B's attention: 16 q heads, 8 kv heads, head_dim 128.
        q, k, cos, sin, norms = _case(tokens, 16, 8, 128, dtype, "cuda", qk_norm)
        with platform.forced_impl(platform.CPU):  # the torch path on CUDA tensors
            ref_q, ref_k = apply_rotary_qk(q, k, cos, sin, 128, *norms)
        out_q, out_k = apply_rotary_qk(q, k, cos, sin, 128, *norms)
        torch.testing.assert_close(out_q, ref_q, **COMPILED_TOL[dtype])
        torch.testing.assert_close(out_k, ref_k, **COMPILED_TOL[dtype])
        # Process-wide count; one row may get its own variant (test_norm_triton.py): from
        # the second row count on it must not grow.
        if tokens == 7:
            first_variants = compiled_variants(rotary_triton._rotary_qk_kernel, ROTARY_DYNAMIC)
    assert compiled_variants(rotary_triton._rotary_qk_kernel, ROTARY_DYNAMIC) == first_variants


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_compiled_one_kv_head() -> None:
    """A single kv head (a count Triton would specialise to a constexpr) still compiles."""
    q, k, cos, sin, norms = _case(5, 4, 1, 64, torch.bfloat16, "cuda", qk_norm=True)
    with platform.forced_impl(platform.CPU):
        ref_q, ref_k = apply_rotary_qk(q, k, cos, sin, 64, *norms)
    out_q, out_k = apply_rotary_qk(q, k, cos, sin, 64, *norms)
    torch.testing.assert_close(out_q, ref_q, **COMPILED_TOL[torch.bfloat16])
    torch.testing.assert_close(out_k, ref_k, **COMPILED_TOL[torch.bfloat16])
