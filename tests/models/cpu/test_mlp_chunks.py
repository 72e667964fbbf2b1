"""The chunked CPU MLP against one pass (moved from tests/models/test_llama.py with the
chunking it tests)."""

from __future__ import annotations

import torch

from mrv2.models import llama
from mrv2.models.cpu import mlp_chunks


@torch.no_grad()
def test_mlp_row_chunks_equal_one_pass(monkeypatch):
    """A long CPU batch runs the MLP in row chunks; the result is the one-pass result."""
    mlp = llama.LlamaMLP(32, 48, bias=False, hidden_act="silu")
    g = torch.Generator().manual_seed(0)
    mlp.gate_up_proj.weight.copy_(torch.randn(96, 32, generator=g) * 0.2)
    mlp.down_proj.weight.copy_(torch.randn(32, 48, generator=g) * 0.2)
    x = torch.randn(300, 32, generator=g)
    mlp_chunks.attach_chunked_mlp(mlp)
    monkeypatch.setattr(mlp_chunks, "CHUNK_BYTES", 8 * 48 * 128)  # 128-row chunks
    assert mlp_chunks.chunk_rows(mlp) == 128
    chunked = mlp(x)
    monkeypatch.setattr(mlp_chunks, "CHUNK_BYTES", 1 << 40)
    torch.testing.assert_close(chunked, mlp(x), rtol=1e-6, atol=1e-6)
