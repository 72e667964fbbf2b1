"""SpecDecodeStats, and the scheduler's verify steps: drafts scheduled, rejected ones rolled
back, the counters."""

from __future__ import annotations

import msgspec
import pytest
import torch

from executor.packed import int32_bytes
from mrv2.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mrv2.core.request import Request
from mrv2.core.scheduler import Scheduler
from mrv2.core.spec_decode_stats import SpecDecodeStats
from mrv2.protocol import ModelRunnerOutput
from mrv2.sampling_params import SamplingParams
from mrv2.spec_decode.config import SpeculativeConfig


def test_counters():
    stats = SpecDecodeStats(3)
    assert stats.mean_acceptance_length == 1.0 and stats.acceptance_rate == 0.0
    stats.record(3, 2)
    stats.record(2, 0)
    assert stats.totals == [2, 5, 2, 1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(0.4)
    assert stats.mean_acceptance_length == pytest.approx(2.0)
    with pytest.raises(ValueError):
        stats.record(1, 2)


def scheduler(budget: int = 32, max_model_len: int = 64, limit: int | None = None) -> Scheduler:
    config = EngineConfig(
        model_config=ModelConfig(model="fake", dtype=torch.float32, max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=4),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=budget, async_scheduling=False,
                                         num_scheduler_steps=1),
        speculative_config=SpeculativeConfig.from_value(
            {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": limit}))
    return Scheduler(config, 64)


def step(sched: Scheduler, tokens: dict[str, list[int]], drafts: dict[str, int]):
    out = sched.schedule()
    ids = out.req_ids
    runner_out = msgspec.structs.replace(
        ModelRunnerOutput.build(ids, [tokens[i] for i in ids]),
        num_draft_tokens_i32=int32_bytes([drafts[i] for i in ids]),
        draft_token_ids_i32=int32_bytes([7] * sum(drafts[i] for i in ids)),
        draft_pauses_i32=int32_bytes([0] * len(ids)))
    return out, sched.update_from_output(out, runner_out)


def add(sched: Scheduler, req_id: str, max_tokens: int = 20) -> Request:
    request = Request(req_id, list(range(10, 20)), SamplingParams(max_tokens=max_tokens),
                      eos_token_id=1, max_model_len=64)
    sched.add_request(request)
    return request


def test_drafts_scheduled_and_rejected_ones_rolled_back():
    sched = scheduler()
    request = add(sched, "r")
    out, _ = step(sched, {"r": [50]}, {"r": 3})  # the prefill; the runner drafted 3
    assert out.num_scheduled.tolist() == [10] and request.num_draft_tokens == 3
    out, outputs = step(sched, {"r": [51, 52]}, {"r": 2})  # 1 of 3 drafts kept
    assert out.num_scheduled.tolist() == [4]
    assert outputs[0].new_token_ids == [51, 52]
    assert request.num_computed_tokens == 12 and request.num_tokens == 13
    out, _ = step(sched, {"r": [53]}, {"r": 0})
    assert out.num_scheduled.tolist() == [3]  # its one token and its 2 drafts
    assert sched.spec_stats.totals == [2, 5, 1, 1, 0, 0]
    out, _ = step(sched, {"r": [54]}, {"r": 0})
    assert out.num_scheduled.tolist() == [1]


def test_drafts_capped_by_max_tokens():
    sched = scheduler()
    request = add(sched, "r", max_tokens=3)
    step(sched, {"r": [50]}, {"r": 3})
    out, _ = step(sched, {"r": [51, 52]}, {"r": 3})
    assert out.num_scheduled.tolist() == [2]  # 1 output so far: at most 2 more a step
    assert request.is_finished and request.output_token_ids == [50, 51, 52]


def test_no_drafts_past_disable_by_batch_size():
    sched = scheduler(limit=1)
    add(sched, "a")
    add(sched, "b")
    step(sched, {"a": [50], "b": [60]}, {"a": 3, "b": 3})
    out, _ = step(sched, {"a": [51], "b": [61]}, {"a": 0, "b": 0})
    assert out.num_scheduled.tolist() == [1, 1]
