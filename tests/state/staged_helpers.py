"""Test-side views of a StagedWriteTensor's host state (production never reads them)."""

from __future__ import annotations

from mrv2.state.staged import StagedWriteTensor


def num_staged(staged: StagedWriteTensor) -> int:
    """Runs staged and not yet applied (`apply()` resets it to 0; empty runs are never staged)."""
    return staged._num_runs
