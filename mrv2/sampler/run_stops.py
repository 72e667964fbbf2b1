"""RunStops: per slot, the token ids that end its request, read by a run of decode steps.

A run (core/decode_steps.py: every row greedy and argmax only, min_tokens 0) computes its steps
in one call of the fused decode stack. Once every row has sampled one of its stop ids there,
the rest of the run is of no use: each request ends at that token and the scheduler drops the
tokens past it. So the call ends there (decode_stack_numba.decode_stack).

The ids are exactly those of the scheduler's stop check (Request.check_stop) for such a row:
its primary EOS and its other EOS ids unless ignore_eos, and its stop_token_ids. A run must
never end on an id the scheduler would go on past: that request would miss the run's later
steps. So a row with more ids than a slot holds gets none, and a run with it goes to its end, as
without this table. Host memory only: the stack runs on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mrv2.sampling_params import SamplingParams

# Stop ids a slot holds: a model's EOS ids, and a few stop_token_ids.
RUN_STOP_WIDTH = 8
NO_STOP = -1  # an empty entry: no token id is negative


class RunStops:
    def __init__(self, max_num_seqs: int) -> None:
        self.ids = np.full((max_num_seqs, RUN_STOP_WIDTH), NO_STOP, dtype=np.int64)

    def add(self, slot: int, params: SamplingParams, eos_token_id: int | None,
            eos_stop_token_ids: Sequence[int]) -> None:
        """The slot's ids for a new (or resumed) request: `eos_token_id` and
        `eos_stop_token_ids` as the request's (NewRequestData)."""
        ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            ids.update(eos_stop_token_ids)
            if eos_token_id is not None:
                ids.add(eos_token_id)
        row = self.ids[slot]
        row[:] = NO_STOP
        if len(ids) <= RUN_STOP_WIDTH:
            row[:len(ids)] = sorted(ids)

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """The slots' ids [len(slots), RUN_STOP_WIDTH] int64 (a copy; NO_STOP pads)."""
        return self.ids[slots]
