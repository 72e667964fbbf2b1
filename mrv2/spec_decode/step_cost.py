"""StepCost: what one more row costs a decode step, measured on the engine's own steps, so a
draft is proposed only where its chance of acceptance pays for its row (drafts.py).

A verify row is a decode row: on a CPU whose GEMVs are bound by arithmetic past one row of x
(AVX2's integer multiply-adds), each costs a large share of a one-row step; on matrix units
almost nothing. So it is measured, not assumed: the wall time of each step of decode and
verify rows only (core/draft_policy.py times them, a multi-step run's per step), averaged per
row count (the first step of each count left out: warm-up's, which compiles kernels), fitted
as t(n) = a + b n. A draft in a step of T requests' rows then pays for itself when its chance
of acceptance exceeds the time of its row over the time of a token, b / (t(T) / T)
(`threshold`). Until two row counts are measured, DEFAULT_THRESHOLD.

Only the draft lengths depend on these timings, never a token: every draft is verified.
"""

from __future__ import annotations

import numpy as np

# Until the fit has two row counts: drafts with a better than even chance are proposed, and
# their steps measure the row count they add.
DEFAULT_THRESHOLD = 0.5
# The threshold's bounds: a measured cost never shuts drafting off, nor makes it free.
MIN_THRESHOLD, MAX_THRESHOLD = 0.05, 0.95
# Weight of each new step in its row count's average (recent steps count most: the context,
# and so attention's share, grows).
STEP_WEIGHT = 0.1


class StepCost:
    def __init__(self, max_rows: int) -> None:
        self.seconds = np.zeros(max_rows + 1)  # average step time per row count
        self.steps = np.zeros(max_rows + 1, dtype=np.int64)  # steps timed per row count

    def record(self, rows: int, steps: int, seconds: float) -> None:
        """A call of `steps` decode steps (a multi-step run's, or one) of `rows` decode and
        verify rows each took `seconds`."""
        if rows >= len(self.seconds):
            return
        elapsed = seconds / steps
        self.steps[rows] += 1
        old = self.seconds[rows]
        self.seconds[rows] = elapsed if self.steps[rows] == 2 else (
            old + STEP_WEIGHT * (elapsed - old))

    @property
    def measured(self) -> np.ndarray:
        """The row counts with a time (a step past their first)."""
        return self.steps > 1

    def threshold(self, num_requests: int) -> float:
        """The chance of acceptance a draft needs in a step of `num_requests` requests' rows:
        one row's time (the fit's slope) over the time per token of such a step."""
        rows = np.flatnonzero(self.measured).tolist()
        if len(rows) < 2:
            return DEFAULT_THRESHOLD
        times = self.seconds[rows].tolist()  # least squares in Python: a handful of counts
        mean_n, mean_t = sum(rows) / len(rows), sum(times) / len(times)
        slope = (sum((n - mean_n) * (t - mean_t) for n, t in zip(rows, times))
                 / sum((n - mean_n) ** 2 for n in rows))
        step = mean_t + slope * (num_requests - mean_n)
        if step <= 0:
            return MIN_THRESHOLD
        return float(np.clip(num_requests * slope / step, MIN_THRESHOLD, MAX_THRESHOLD))
