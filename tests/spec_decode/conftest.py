"""Speculative-decoding test fixtures."""

from __future__ import annotations

import pytest

from mrv2.spec_decode import step_cost


@pytest.fixture
def rows_cost_little(monkeypatch):
    """Every step's draft threshold at its floor (as on matrix units, where a verify row
    costs little), whatever this machine's steps measure: tests that count drafts get them."""
    monkeypatch.setattr(step_cost.StepCost, "threshold",
                        lambda self, num_requests: step_cost.MIN_THRESHOLD)
