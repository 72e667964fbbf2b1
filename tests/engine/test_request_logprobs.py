"""Logprobs from the runner's output to the user: the scheduler carries them (and drops them
with the tokens it drops), the output processor builds vLLM's dicts per output kind."""

from __future__ import annotations

import pytest
import torch

from mrv2.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mrv2.core.request import Request, RequestStatus
from mrv2.core.scheduler import Scheduler
from mrv2.engine.output_processor import OutputProcessor
from mrv2.engine.request_logprobs import RequestLogprobs, TokenTexts, make_logprob_dict
from mrv2.outputs import Logprob, RequestOutputKind
from mrv2.protocol import (EngineCoreOutput, FinishReason, ModelRunnerOutput, PromptLogprobsChunk,
                           SampledTokenLogprobs)
from mrv2.sampling_params import SamplingParams

DELTA, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE


class FakeTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return f"<{ids[0]}>"


def lp(token: int, *top: int, rank: int = 1) -> SampledTokenLogprobs:
    ids = [token, *top]
    # A token's value depends on the token only, as in real logprobs.
    return SampledTokenLogprobs(token_ids=ids, logprobs=[-t / 100 for t in ids], rank=rank)


def chunk(start: int, tokens: list[int]) -> PromptLogprobsChunk:
    positions = range(start, start + len(tokens))
    return PromptLogprobsChunk(start=start, token_ids=[[t, 9] for t in tokens],
                               logprobs=[[-1.0 - p, -0.1] for p in positions],
                               ranks=[5] * len(tokens))


def test_dict_order_ranks_and_a_sampled_token_in_the_top_k():
    texts = TokenTexts(FakeTokenizer())
    d = make_logprob_dict([7, 3, 7, 4], [-1.0, -0.2, -1.0, -1.5], 3, texts([7, 3, 7, 4]))
    # vLLM: the sampled token keeps its first position and takes its top-k entry (rank 2).
    assert d == {7: Logprob(-1.0, 2, "<7>"), 3: Logprob(-0.2, 1, "<3>"),
                 4: Logprob(-1.5, 3, "<4>")}
    assert list(d) == [7, 3, 4]
    assert make_logprob_dict([8, 3], [-4.0, -0.2], 17, [None, None]) == {
        8: Logprob(-4.0, 17, None), 3: Logprob(-0.2, 1, None)}


def test_token_texts_are_cached_and_none_without_a_tokenizer():
    tokenizer = FakeTokenizer()
    texts = TokenTexts(tokenizer)
    assert texts([5, 6, 5]) == ["<5>", "<6>", "<5>"] and tokenizer.calls == 2
    assert TokenTexts(None)([5, 6]) == [None, None]


def test_prompt_chunks_append_in_order_and_skip_recomputed_rows():
    acc = RequestLogprobs(None, 1, TokenTexts(None))
    acc.add_prompt(chunk(0, [11, 12]))
    acc.add_prompt(chunk(0, [11, 12, 13]))  # recomputed after a preemption: row 2 is new
    acc.add_prompt(chunk(3, [14]))
    assert acc.prompt_logprobs[0] is None
    assert [list(d)[0] for d in acc.prompt_logprobs[1:]] == [11, 12, 13, 14]
    assert acc.prompt_logprobs[4][14].logprob == -4.0 and acc.prompt_logprobs[4][14].rank == 5
    with pytest.raises(RuntimeError, match="position 6"):
        acc.add_prompt(chunk(6, [1]))
    assert acc.prompt_out(delta=True) is acc.prompt_logprobs
    assert acc.prompt_out(delta=True) is None  # DELTA: once
    assert acc.logprobs is None and acc.cumulative_logprob is None


def test_sample_logprobs_must_match_the_new_tokens():
    acc = RequestLogprobs(2, None, TokenTexts(None))
    acc.add_sample([lp(5, 5, 6)], 1)
    acc.add_sample([lp(8, 6, 7, rank=3)], 1)
    assert acc.cumulative_logprob == pytest.approx(-0.13)
    assert acc.sample_out(delta=True, num_new_tokens=1) == [acc.logprobs[1]]
    assert acc.sample_out(delta=False, num_new_tokens=2) == acc.logprobs
    with pytest.raises(RuntimeError, match="1 new tokens but 0"):
        acc.add_sample(None, 1)


def test_output_processor_streams_logprobs_with_their_tokens():
    proc = OutputProcessor(None)
    params = SamplingParams(logprobs=1, prompt_logprobs=1)
    proc.add_request("a", None, [1, 11, 12, 13], params, DELTA)
    # A prefill chunk's prompt logprobs alone make no RequestOutput.
    assert proc.process_outputs([EngineCoreOutput("a", [], new_prompt_logprobs=chunk(
        0, [11, 12]))]).request_outputs == []
    [first] = proc.process_outputs([EngineCoreOutput(
        "a", [50], new_logprobs=[lp(50, 50)],
        new_prompt_logprobs=chunk(2, [13]))]).request_outputs
    assert [None if d is None else list(d) for d in first.prompt_logprobs] == [
        None, [11, 9], [12, 9], [13, 9]]
    assert first.outputs[0].logprobs == [{50: Logprob(-0.5, 1, None)}]
    [second] = proc.process_outputs([EngineCoreOutput(
        "a", [60], FinishReason.LENGTH, new_logprobs=[lp(60, 61, rank=2)])]).request_outputs
    assert second.prompt_logprobs is None  # DELTA: sent with the first output only
    assert second.outputs[0].token_ids == [60] and list(second.outputs[0].logprobs[0]) == [60, 61]
    assert second.outputs[0].cumulative_logprob == pytest.approx(-1.1)


def test_cumulative_n2_outputs_align_logprobs_and_share_prompt_logprobs():
    proc = OutputProcessor(None)
    params = SamplingParams(n=2, logprobs=0, prompt_logprobs=0)
    ids = proc.add_request("p", None, [1, 11], params, CUMULATIVE,
                           [params.clone(n=1)] * 2)
    [o] = proc.process_outputs([EngineCoreOutput(ids[0], [5], new_logprobs=[lp(5)],
                                                 new_prompt_logprobs=chunk(0, [11]))]
                               ).request_outputs
    assert len(o.prompt_logprobs) == 2 and o.outputs[0].logprobs == [{5: Logprob(-0.05, 1, None)}]
    [o] = proc.process_outputs([EngineCoreOutput(ids[0], [6], new_logprobs=[lp(6)])]
                               ).request_outputs
    assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) == 2
    assert len(o.prompt_logprobs) == 2  # CUMULATIVE: every output


def make_scheduler(budget: int = 4) -> Scheduler:
    config = EngineConfig(
        model_config=ModelConfig(model="fake", dtype=torch.float32, max_model_len=64),
        cache_config=CacheConfig(block_size=4),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                         async_scheduling=False))
    return Scheduler(config, 32)


def test_scheduler_carries_prompt_chunks_and_sample_logprobs():
    sched = make_scheduler()
    sched.add_request(Request("a", list(range(10, 16)), SamplingParams(
        max_tokens=2, logprobs=1, prompt_logprobs=1, ignore_eos=True), eos_token_id=1))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    c0 = chunk(0, [11, 12, 13, 14])
    [o] = sched.update_from_output(out, ModelRunnerOutput.build(["a"], [[]], [None],
                                                          prompt_logprobs={"a": c0}))
    assert o.new_token_ids == [] and o.new_prompt_logprobs == c0 and o.new_logprobs is None
    out = sched.schedule()
    c1 = chunk(4, [15])
    [o] = sched.update_from_output(out, ModelRunnerOutput.build(["a"], [[7]], [[lp(7, 8)]],
                                                          prompt_logprobs={"a": c1}))
    assert (o.new_token_ids, o.new_logprobs, o.new_prompt_logprobs) == ([7], [lp(7, 8)], c1)
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    # Output of a request finished meanwhile is dropped, logprobs included.
    assert sched.update_from_output(out, ModelRunnerOutput.build(["a"], [[9]], [[lp(9)]])) == []


def test_prompt_logprobs_skip_the_prefix_cache_until_the_request_sampled():
    sched = make_scheduler(budget=32)
    prompt = list(range(10, 23))
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=1), eos_token_id=1))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput.build(["a"], [[5]]))
    manager = sched.kv_cache_manager
    plain = Request("b", prompt, SamplingParams(max_tokens=1))
    asking = Request("c", prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert manager.get_computed_blocks(plain)[1] == 12
    assert asking.skip_reading_prefix_cache and manager.get_computed_blocks(asking) == (([],), 0)
    asking.append_output_token_ids(5)  # resumed after sampling: prompt logprobs were sent
    assert not asking.skip_reading_prefix_cache
    assert manager.get_computed_blocks(asking)[1] == 12
