"""Speculative-decoding test fixtures."""

from __future__ import annotations

import pytest

from mrv2.core import scheduler as scheduler_module
from mrv2.spec_decode import step_cost


@pytest.fixture
def rows_cost_little(monkeypatch):
    """Every step's draft threshold at its floor (as on matrix units, where a verify row
    costs little), whatever this machine's steps measure: tests that count drafts get them."""
    monkeypatch.setattr(step_cost.StepCost, "threshold",
                        lambda self, num_requests: step_cost.MIN_THRESHOLD)


@pytest.fixture
def drafted_again_after_a_run(monkeypatch):
    """Records each scheduled step (the decode steps it runs, whether a running request holds
    drafts) as the scheduler asks core/decode_steps.py; returns a check: whether a step after
    the first multi-step run verified drafts."""
    calls: list[tuple[int, bool]] = []
    real = scheduler_module.decode_steps

    def counted(running, *args):
        calls.append((real(running, *args), any(r.num_draft_tokens for r in running)))
        return calls[-1][0]

    def check() -> bool:
        first_run = next(i for i, (steps, _) in enumerate(calls) if steps > 1)
        return any(verifies for _, verifies in calls[first_run:])

    monkeypatch.setattr(scheduler_module, "decode_steps", counted)
    return check
