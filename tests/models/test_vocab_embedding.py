"""Vocabulary-parallel embedding and LM head: shards combine into the unsharded layers."""

from __future__ import annotations

import pytest
import torch

from mrv2.models.layers.vocab_embedding import (ParallelLMHead, VocabParallelEmbedding,
                                                parallel_logits, vocab_range)


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
