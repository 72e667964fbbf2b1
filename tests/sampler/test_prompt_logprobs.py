"""PromptLogprobsState: which requests are tracked, and the rows a step computes for them."""

from __future__ import annotations

import numpy as np
import torch

from mrv2.sampler.prompt_logprobs import PromptLogprobsState

V = 50


def make() -> tuple[PromptLogprobsState, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return PromptLogprobsState(V, torch.device("cpu")), torch.randn(V, 8, generator=g)


def test_tracking_rules():
    state, _ = make()
    assert not state
    state.add("none", [1, 2, 3], 3, None)  # did not ask
    state.add("short", [1], 1, 2)  # a one-token prompt has no row
    state.add("resumed", [1, 2, 3], 5, 2)  # resumed after sampling: rows were delivered
    assert not state
    state.add("a", [1, 2, 3], 3, 2)
    assert state and set(state.tracked) == {"a"}
    state.finish("a")
    state.finish("unknown")
    assert not state


def test_rows_of_each_chunk_and_untracked_after_the_prompt():
    """Two rows in one batch: 'a' (prompt of 7) in chunks of 4 then 3 (+ its last token);
    'b' untracked. Row p predicts prompt token p + 1."""
    state, head = make()
    prompt = [3, 14, 15, 9, 26, 5, 35]
    state.add("a", prompt, len(prompt), 3)
    hidden = torch.randn(12, 8)
    calls: list[int] = []

    def logits(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ head.T

    # Batch rows: b (1 token at hidden[0]), a (4 tokens at hidden[1:5]).
    out = state.compute(["b", "a"], np.array([9, 0]), np.array([1, 4]), np.array([0, 1, 5]),
                        hidden, logits)
    start, rows = out["a"]
    assert list(out) == ["a"] and start == 0 and rows.token_ids.shape == (4, 4)
    ref = torch.log_softmax(hidden[1:5] @ head.T, -1)
    assert rows.token_ids[:, 0].tolist() == prompt[1:5]
    torch.testing.assert_close(rows.logprobs[:, 0], ref[torch.arange(4), prompt[1:5]])
    assert rows.token_ids[:, 1:].tolist() == ref.topk(3).indices.tolist()
    assert state  # 2 prompt rows left
    # The rest of the prompt (positions 4..6): rows 4 and 5 only, then untracked.
    out = state.compute(["a"], np.array([4]), np.array([3]), np.array([0, 3]), hidden, logits)
    start, rows = out["a"]
    assert start == 4 and rows.token_ids[:, 0].tolist() == prompt[5:7]
    assert not state


def test_chunk_size_bounds_the_logits():
    state, head = make()
    state.chunk_size = 3
    state.add("a", list(range(1, 12)), 11, 0)
    calls: list[int] = []

    def logits(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ head.T

    out = state.compute(["a"], np.array([0]), np.array([11]), np.array([0, 11]),
                        torch.randn(11, 8), logits)
    assert calls == [3, 3, 3, 1] and out["a"][1].token_ids.shape == (10, 1)
    assert PromptLogprobsState(32_000, torch.device("cpu")).chunk_size == 524
