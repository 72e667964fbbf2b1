"""PoolingState against a plain torch reference: LAST is the row's last hidden state; MEAN the
mean of a prompt's hidden states over its prefill chunks, whichever slots and steps they ran
in, started over when a slot is reused (a new request, or a preempted one re-added)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mrv2.config import PoolerConfig
from mrv2.state.pooling import PoolingState

HIDDEN, SLOTS = 8, 4


def step(state: PoolingState, rows: list[tuple[int, int]], prompt_len: torch.Tensor,
         gen: torch.Generator):
    """One step: `rows` (slot, scheduled tokens) in batch order. Returns the step's hidden
    states and the pooled [num_reqs, hidden]."""
    counts = [n for _, n in rows]
    hidden = torch.randn(sum(counts), HIDDEN, generator=gen)
    batch = SimpleNamespace(num_tokens=sum(counts),
                            idx_mapping=torch.tensor([s for s, _ in rows], dtype=torch.int64),
                            num_scheduled=torch.tensor(counts, dtype=torch.int32))
    last = hidden[torch.tensor(counts).cumsum(0) - 1]
    state.apply_staged_writes()
    return hidden, state.pool(hidden, last, batch, prompt_len)


def test_last_is_each_rows_last_hidden_state():
    state = PoolingState(PoolerConfig(), SLOTS, HIDDEN, torch.device("cpu"))
    assert state.sums is None
    hidden, pooled = step(state, [(2, 3), (0, 1)], torch.zeros(SLOTS, dtype=torch.int32),
                          torch.Generator().manual_seed(0))
    assert pooled.dtype == torch.float32
    torch.testing.assert_close(pooled, hidden[[2, 3]])


def test_mean_sums_chunks_per_slot_and_starts_over_on_add():
    gen = torch.Generator().manual_seed(0)
    state = PoolingState(PoolerConfig("mean", normalize=False), SLOTS, HIDDEN,
                         torch.device("cpu"))
    assert state.pooling_type == "MEAN"
    prompt_len = torch.tensor([2, 0, 0, 6], dtype=torch.int32)
    state.add(3)
    state.add(0)
    # Slot 3's prompt of 6 runs in chunks of 4 and 2; slot 0's prompt of 2 in one step.
    h1, p1 = step(state, [(3, 4), (0, 2)], prompt_len, gen)
    torch.testing.assert_close(p1[1], h1[4:6].mean(0))
    h2, p2 = step(state, [(3, 2)], prompt_len, gen)
    torch.testing.assert_close(p2[0], torch.cat([h1[:4], h2]).mean(0))
    # Slot 0 is reused by a new request of 3 tokens: its old sum is gone.
    prompt_len[0] = 3
    state.add(0)
    h3, p3 = step(state, [(0, 3)], prompt_len, gen)
    torch.testing.assert_close(p3[0], h3.mean(0))


def test_mean_accumulates_in_float32_from_half_hidden_states():
    state = PoolingState(PoolerConfig("MEAN"), SLOTS, HIDDEN, torch.device("cpu"))
    state.add(1)
    hidden = torch.full((5, HIDDEN), 1.0 / 3, dtype=torch.bfloat16)
    batch = SimpleNamespace(num_tokens=5, idx_mapping=torch.tensor([1]),
                            num_scheduled=torch.tensor([5], dtype=torch.int32))
    state.apply_staged_writes()
    pooled = state.pool(hidden, hidden[4:], batch, torch.tensor([0, 5, 0, 0]))
    assert pooled.dtype == torch.float32
    torch.testing.assert_close(pooled[0], hidden.float().mean(0))
