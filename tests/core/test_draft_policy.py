"""DraftPolicy (core/draft_policy.py): drafts verified within the step's limits, steps timed
into the threshold the runner drafts by, prompt steps left out."""

from __future__ import annotations

import pytest

from mrv2.core.draft_policy import DraftPolicy
from mrv2.core.request import Request
from mrv2.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from mrv2.sampling_params import SamplingParams
from mrv2.spec_decode.config import SpeculativeConfig
from mrv2.spec_decode.step_cost import DEFAULT_THRESHOLD


def policy(**spec) -> DraftPolicy:
    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3,
                                           **spec})
    return DraftPolicy(config, max_num_seqs=4, max_model_len=64)


def step(tokens: dict[str, int], steps: int = 1, new: bool = False) -> SchedulerOutput:
    new_reqs = [NewRequestData("n", [1], [1], SamplingParams(), [[1]], 0)] if new else []
    return SchedulerOutput.build(new_reqs, CachedRequestData(), tokens, sum(tokens.values()),
                                 num_decode_steps=steps)


def test_drafts_within_budget_max_tokens_and_batch_size():
    request = Request("r", list(range(10)), SamplingParams(max_tokens=5), eos_token_id=1,
                      max_model_len=64)
    request.num_draft_tokens = 4
    assert policy().num_drafts(request, budget=64, num_running=1) == 4
    assert policy().num_drafts(request, budget=3, num_running=1) == 2
    request.append_output_token_ids([7, 7])
    assert policy().num_drafts(request, budget=64, num_running=1) == 2  # 3 tokens left
    assert policy(disable_by_batch_size=2).num_drafts(request, 64, num_running=3) == 0


def test_decode_steps_timed_into_the_threshold():
    drafts = policy()
    assert drafts.threshold(1) == DEFAULT_THRESHOLD
    drafts.record_step(step({"a": 1}), 9.0)  # first of its count: warm-up
    drafts.record_step(step({"a": 3}), 9.0)
    drafts.record_step(step({"a": 1}, steps=4), 0.040)  # a run: 10 ms a step
    drafts.record_step(step({"a": 3}), 0.020)
    drafts.record_step(step({"a": 40}), 1.0)  # a prompt chunk: more than its verify rows
    drafts.record_step(step({"a": 1}, new=True), 1.0)  # admits a request
    assert drafts.threshold(1) == pytest.approx(0.5)
