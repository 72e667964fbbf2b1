"""DraftPolicy: the scheduler's side of speculative decoding: how many of a request's drafts a
step verifies, and what a verify row costs, measured on the engine's own steps (StepCost) and
handed to the runner with each step (SchedulerOutput.draft_threshold), whose DraftState drafts
only as many tokens as pay for their rows.

The costs are measured here, in the one engine core, so every tensor-parallel rank proposes
from the same threshold (their drafts must agree), and each step's time is the whole of it:
the scheduler, the runner and the output path (EngineCore times from scheduling to folding).
"""

from __future__ import annotations

from mrv2.core.request import Request
from mrv2.protocol import SchedulerOutput
from mrv2.spec_decode.config import SpeculativeConfig
from mrv2.spec_decode.step_cost import StepCost


class DraftPolicy:
    def __init__(self, config: SpeculativeConfig, max_num_seqs: int, max_model_len: int
                 ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.cost = StepCost(max_num_seqs * (1 + config.num_speculative_tokens))  # rows a step

    def num_drafts(self, request: Request, budget: int, num_running: int) -> int:
        """The drafts a decode verifies this step: all the runner holds, within the budget,
        the request's max_tokens and max_model_len (a verify step yields up to one token
        more than its drafts), none while more requests run than disable_by_batch_size."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            return 0
        return max(0, min(request.num_draft_tokens, budget - 1,
                          request.max_tokens - len(request.output_token_ids) - 1,
                          self.max_model_len - request.num_tokens - 1))

    def threshold(self, num_requests: int) -> float:
        """The chance of acceptance a draft needs in a step of `num_requests` requests."""
        return self.cost.threshold(num_requests)

    def record_step(self, step: SchedulerOutput, seconds: float) -> None:
        """A step's wall time, from its scheduling to its output folded in. Steps that admit
        requests or run prompt chunks (more tokens than their requests' verify rows) are left
        out: the fit is of decode and verify rows."""
        rows = step.total_num_scheduled_tokens
        if step.scheduled_new_reqs or not 0 < rows <= step.num_reqs * (
                1 + self.config.num_speculative_tokens):
            return
        self.cost.record(rows, step.num_decode_steps, seconds)
