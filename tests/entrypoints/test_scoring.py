"""Embedding scores: pairing (1:1, 1:N, N:N), cosine similarity, vLLM's prompt ids."""

from __future__ import annotations

import pytest
import torch

from mrv2.entrypoints.scoring import as_inputs, cosine_score, score_pairs, scoring_outputs
from mrv2.outputs import PoolingOutput, PoolingRequestOutput


def test_pairs():
    assert score_pairs(1, 1) == [(0, 0)]
    assert score_pairs(1, 3) == [(0, 0), (0, 1), (0, 2)]
    assert score_pairs(2, 2) == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        score_pairs(2, 3)
    with pytest.raises(ValueError, match="at least one"):
        score_pairs(0, 1)
    assert as_inputs("a") == ["a"] and as_inputs({"prompt": "a"}) == [{"prompt": "a"}]
    assert as_inputs(("a", "b")) == ["a", "b"]


def test_scores_are_cosine_similarities():
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(8, generator=gen) for _ in range(3)]
    outs = [PoolingRequestOutput(str(i), PoolingOutput(v), [i, i]) for i, v in enumerate(vectors)]
    scores = scoring_outputs(outs[:1], outs[1:], pad_token_id=7)
    assert [s.request_id for s in scores] == ["0_1", "0_2"]
    assert scores[0].prompt_token_ids == [0, 0, 7, 1, 1]
    for score, other in zip(scores, vectors[1:]):
        want = float(vectors[0] @ other / (vectors[0].norm() * other.norm()))
        assert score.outputs.score == pytest.approx(want, abs=1e-6)
    assert cosine_score(vectors[0], 2 * vectors[0]) == pytest.approx(1.0)
    assert scoring_outputs(outs[:1], outs[:1], None)[0].prompt_token_ids == [0, 0, 0, 0]
