"""Vocabulary-parallel embedding and LM head: shards combine into the unsharded layers; a
packed weight (linear.set_packed) is what lookups and logits read."""

from __future__ import annotations

import pytest
import torch

from mrv2.models.layers.linear import set_packed
from mrv2.models.layers.quantized import PackedWeight, quantized_linear
from mrv2.models.layers.vocab_embedding import (ParallelLMHead, VocabParallelEmbedding,
                                                float32_logits, parallel_logits, vocab_range)


@pytest.mark.parametrize("vocab, tp", [(10, 1), (10, 2), (10, 4), (7, 3)])
def test_vocab_ranges_cover_the_vocabulary_once(vocab, tp):
    covered = []
    for rank in range(tp):
        start, rows, padded = vocab_range(vocab, rank, tp)
        assert rows <= padded == -(-vocab // tp)
        covered += range(start, start + rows)
    assert covered == list(range(vocab))


def test_single_rank_embedding_and_head_match_dense():
    table = torch.randn(10, 6)
    emb = VocabParallelEmbedding(10, 6, tp_rank=0, tp_size=1)
    head = ParallelLMHead(10, 6, tp_rank=0, tp_size=1)
    for layer in (emb, head):
        layer.weight.weight_loader(layer.weight, table)
    ids = torch.tensor([0, 3, 9, 3])
    assert torch.equal(emb(ids), table[ids])
    hidden = torch.randn(4, 6)
    assert torch.allclose(parallel_logits(hidden, head), hidden @ table.T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_packed_table_is_what_lookups_and_logits_read(dtype):
    """Lookups widen the packed rows exactly; logits are quantized_linear's float32 sums on
    the packed weight; the float32 table is released."""
    table = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    emb = VocabParallelEmbedding(10, 64, tp_rank=0, tp_size=1)
    emb.weight.weight_loader(emb.weight, table)
    packed = PackedWeight.from_float(emb.weight, dtype)
    set_packed(emb, packed)
    assert emb.packed is packed and emb.weight.numel() == 0
    ids = torch.tensor([[0, 3], [9, 3]])  # any shape of ids
    assert torch.equal(emb(ids), table.to(dtype).float()[ids])
    hidden = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(parallel_logits(hidden, emb),
                       quantized_linear(hidden, packed, float32_sums=True))


def _near_tie_16bit(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16-bit hidden row and head whose two logits are 1/64 apart near 25: one value on
    a bfloat16 grid (0.125 apart there)."""
    hidden = torch.tensor([[25.0, 1.0 / 64]], device=device).to(dtype)
    weight = torch.tensor([[1.0, 0.0], [1.0, 1.0]], device=device).to(dtype)
    return hidden, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_logits_are_float32_sums(dtype):
    hidden, weight = _near_tie_16bit("cpu", dtype)
    logits = float32_logits(hidden, weight)
    assert logits.dtype == torch.float32
    assert logits.tolist() == [[25.0, 25.0 + 1.0 / 64]]  # exact: no tie, token 1 wins
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(3, 40, generator=g).to(dtype), torch.randn(9, 40, generator=g).to(dtype)
    torch.testing.assert_close(float32_logits(h, w), h.double() @ w.double().T,
                               rtol=1e-5, atol=1e-5, check_dtype=False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_logits_are_float32_sums_on_cuda(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    hidden, weight = _near_tie_16bit("cuda", dtype)
    logits = float32_logits(hidden, weight)
    assert logits.dtype == torch.float32
    assert logits.cpu().tolist() == [[25.0, 25.0 + 1.0 / 64]]
