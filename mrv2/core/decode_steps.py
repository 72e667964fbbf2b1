"""How many decode steps one scheduled step runs (vLLM's multi-step scheduling,
`SchedulerConfig.num_scheduler_steps`).

Why: a decode step of a small batch spends a large share of its time outside the forward (the
scheduler, the runner's bookkeeping, the output processing, each a few tens of microseconds;
more after the forward has streamed the weights through the caches). Running several decode
steps per scheduled step pays the scheduler's and the engine's part once for all of them.

When: the runner samples each inner step's tokens itself, so every running row must decode
one token by argmax (`SamplingParams.decodes_by_argmax`: no stage reads the logits beyond the
argmax, no stop string to find in the text, no grammar) and hold no drafts to verify
(speculative decoding runs such runs while its requests back off: no longer than the steps
before one may draft again, Request.steps_without_drafts), and nothing may be waiting
(a new request would wait for the whole run). The count never takes a row past its max_tokens or
max_model_len; a stop token inside the run ends its request there, the later tokens of that
row being dropped (Scheduler.update_from_output), as vLLM's multi-step did.

By default (`num_scheduler_steps=None`) runs are made while every running request takes its
output when it finishes (output_kind FINAL_ONLY: `LLM.generate`, an `LLMEngine` request without
streaming): nobody sees its tokens arrive, so a run changes nothing a caller observes but the
time. Their length (`AutoRunLength`) is AUTO_DECODE_STEPS, or more where steps are short: a run
lasts about AUTO_RUN_SECONDS, up to AUTO_DECODE_STEPS_MAX steps, so that the scheduled step's
own host work (~1 ms on the CPU) stays a few percent of it, and a request added meanwhile waits
little. A run ends early where every row stops (sampler/run_stops.py), so a longer one wastes
no step past a stop. A row that streams (DELTA / CUMULATIVE: the server's, an
`AsyncLLM` stream) keeps the batch at one step, its tokens arriving one at a time. An explicit
count runs for streaming rows too (they then receive tokens that many at a time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mrv2.config import AUTO_DECODE_STEPS
from mrv2.core.request import Request
from mrv2.outputs import RequestOutputKind


# A run made by default lasts about this long (bench/README.md, "Runs of decode steps as long
# as ...").
AUTO_RUN_SECONDS = 0.025
AUTO_DECODE_STEPS_MAX = 32
# The weight of a run's measured seconds per step in the running estimate.
_NEW_WEIGHT = 0.25


class AutoRunLength:
    """The length of the runs made by default: AUTO_DECODE_STEPS until a run has been timed,
    then as many steps as last about AUTO_RUN_SECONDS (at least AUTO_DECODE_STEPS, at most
    AUTO_DECODE_STEPS_MAX), from a running estimate of a decode step's seconds in runs. Not
    `timed` (speculative decoding, whose requests run runs while they back off from drafting
    and whose draft policy counts on those): always AUTO_DECODE_STEPS."""

    def __init__(self, timed: bool = True) -> None:
        self.timed = timed
        self.step_seconds: float | None = None

    def record(self, num_decode_steps: int, seconds: float) -> None:
        """A scheduled step of `num_decode_steps` (> 1: a run) took `seconds`, scheduled to
        folded back (EngineCore)."""
        if not self.timed or num_decode_steps <= 1 or seconds <= 0.0:
            return
        per_step = seconds / num_decode_steps
        last = self.step_seconds
        self.step_seconds = per_step if last is None else (
            last + _NEW_WEIGHT * (per_step - last))

    @property
    def steps(self) -> int:
        if self.step_seconds is None:
            return AUTO_DECODE_STEPS
        return max(AUTO_DECODE_STEPS, min(AUTO_DECODE_STEPS_MAX,
                                          math.ceil(AUTO_RUN_SECONDS / self.step_seconds)))


def decode_steps(running: Sequence[Request], num_waiting: int, num_scheduler_steps: int | None,
                 max_model_len: int, num_free_blocks: int, block_size: int,
                 auto_steps: int = AUTO_DECODE_STEPS) -> int:
    """The decode steps the next scheduled step runs: `num_scheduler_steps` (None: auto, see
    above, `auto_steps` long: AutoRunLength.steps) or fewer, 1 where the rule above does not
    hold. A row's known tokens include its placeholders (async scheduling: tokens of a step in
    flight). The pool must hold the blocks every row may need for the run (so that it never
    preempts for it)."""
    auto = num_scheduler_steps is None
    steps = auto_steps if auto else num_scheduler_steps
    if steps == 1 or num_waiting or not running:
        return 1
    for request in running:
        placeholders = request.num_output_placeholders
        known = len(request.all_token_ids) + placeholders
        params = request.sampling_params
        if (known - request.num_computed_tokens != 1 or request.grammar is not None
                or request.num_draft_tokens
                or not params.decodes_by_argmax
                or (auto and params.output_kind != RequestOutputKind.FINAL_ONLY)):
            return 1
        steps = min(steps, request.max_tokens - len(request.output_token_ids) - placeholders,
                    max_model_len - known, request.steps_without_drafts)
        if steps <= 1:
            return 1
    # A row's run of `steps` tokens spans at most this many blocks it may not hold yet.
    if len(running) * (-(-steps // block_size) + 1) > num_free_blocks:
        return 1
    return steps
