"""Scheduler tests, driven by a fake runner that keeps the runner's view of each request.

Tokens are a pure function of (request id, position), so the final sequences must not depend
on batching, chunking or preemption.
"""

from __future__ import annotations

import zlib
from collections import Counter, defaultdict
from collections.abc import Callable

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrv2.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mrv2.engine.request import Request, RequestStatus
from mrv2.engine.scheduler import Scheduler
from mrv2.protocol import FinishReason, ModelRunnerOutput, SchedulerOutput
from mrv2.sampling_params import SamplingParams

EOS = 1
TokenFn = Callable[[str, int], int]


def token_for(req_id: str, position: int) -> int:
    return 100 + zlib.crc32(f"{req_id}:{position}".encode()) % 900  # never EOS


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32,
                   max_num_seqs: int = 8, max_model_len: int = 64,
                   chunked: bool = True) -> Scheduler:
    config = EngineConfig(
        model_config=ModelConfig(model="fake", dtype=torch.float32, max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=budget,
                                         max_model_len=max_model_len,
                                         enable_chunked_prefill=chunked))
    return Scheduler(config, num_blocks)


def make_request(req_id: str, prompt_len: int, max_tokens: int | None = 8,
                 max_model_len: int = 64, **params) -> Request:
    prompt = [token_for(req_id, p) for p in range(prompt_len)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_id=EOS, max_model_len=max_model_len)


class FakeRunner:
    """Mirrors the real runner's bookkeeping and asserts what it relies on."""

    def __init__(self, block_size: int, token_fn: TokenFn = token_for) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.history: dict[str, list[int]] = {}  # tokens held when last preempted
        self.finished_seen: Counter[str] = Counter()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
        assert decoded == out
        self.finished_seen.update(out.finished_req_ids)
        for rid in out.finished_req_ids:
            self._drop(rid)
        for rid in out.preempted_req_ids:
            self.history[rid] = self.tokens[rid]
            self._drop(rid)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tokens
            assert new.prefill_token_ids[:len(new.prompt_token_ids)] == new.prompt_token_ids
            if new.req_id in self.history:  # resumed: prompt + every output so far
                assert new.prefill_token_ids == self.history.pop(new.req_id)
            else:
                assert new.prefill_token_ids == new.prompt_token_ids
            self.tokens[new.req_id] = list(new.prefill_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.blocks[new.req_id] = list(new.block_ids)
        cached = out.scheduled_cached_reqs
        for rid, delta, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens):
            assert self.computed[rid] == num_computed
            self.blocks[rid] += delta
        sampled = []
        for rid, n in out.num_scheduled_tokens.items():
            self.computed[rid] += n
            assert 0 < n and self.computed[rid] <= len(self.tokens[rid])
            # Blocks cover exactly the computed tokens: allocation is never speculative.
            assert len(self.blocks[rid]) == -(-self.computed[rid] // self.block_size)
            if self.computed[rid] == len(self.tokens[rid]):
                self.tokens[rid].append(self.token_fn(rid, len(self.tokens[rid])))
                sampled.append(self.tokens[rid][-1:])
            else:
                sampled.append([])  # mid-prefill chunk: nothing sampled
        owned = [b for blocks in self.blocks.values() for b in blocks]
        assert 0 not in owned and len(owned) == len(set(owned))
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)

    def _drop(self, rid: str) -> None:
        self.tokens.pop(rid, None)
        self.computed.pop(rid, None)
        self.blocks.pop(rid, None)


def step(sched: Scheduler, runner: FakeRunner, results: dict, finish: dict) -> SchedulerOutput:
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert sched.num_running <= sched.max_num_seqs
    assert list(out.num_scheduled_tokens) == (out.scheduled_cached_reqs.req_ids
                                              + [r.req_id for r in out.scheduled_new_reqs])
    mro = runner.execute(out)
    for rid in out.num_scheduled_tokens:  # base list + deltas == the scheduler's list
        assert runner.blocks[rid] == sched.kv_cache_manager.get_block_ids(rid)
    for o in sched.update_from_output(out, mro):
        assert o.request_id not in finish
        results[o.request_id] += o.new_token_ids
        if o.finished:
            finish[o.request_id] = (o.finish_reason, o.stop_reason)
    return out


def run_all(sched: Scheduler, runner: FakeRunner, arrivals: dict[int, list[Request]] | None = None,
            max_steps: int = 5000) -> tuple[dict, dict, list[SchedulerOutput]]:
    arrivals = dict(arrivals or {})
    results: dict[str, list[int]] = defaultdict(list)
    finish: dict[str, tuple] = {}
    outs = []
    while arrivals or sched.has_unfinished_requests() or sched.has_finished_requests():
        for req in arrivals.pop(len(outs), []):
            sched.add_request(req)
        outs.append(step(sched, runner, results, finish))
        assert len(outs) < max_steps, "scheduler made no progress"
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1  # every block came back
    assert all(c == 1 for c in runner.finished_seen.values())
    assert set(runner.finished_seen) == set(finish)
    return results, finish, outs


def expected(req: Request) -> list[int]:
    return [token_for(req.request_id, p)
            for p in range(req.num_prompt_tokens, req.num_prompt_tokens + req.max_tokens)]


def test_single_request_prefill_then_decode() -> None:
    sched, runner = make_scheduler(), FakeRunner(4)
    req = make_request("a", 11, max_tokens=3)
    sched.add_request(req)
    assert (sched.num_waiting, sched.get_num_unfinished_requests()) == (1, 1)
    results, finish, outs = run_all(sched, runner)
    assert [o.num_scheduled_tokens for o in outs] == [{"a": 11}, {"a": 1}, {"a": 1}, {}]
    assert len(outs[0].scheduled_new_reqs[0].block_ids) == 3
    assert outs[1].scheduled_cached_reqs.new_block_ids == [[]]  # position 11 is in block 3
    assert len(outs[2].scheduled_cached_reqs.new_block_ids[0]) == 1  # position 12: block 4
    assert outs[-1].finished_req_ids == ["a"] and outs[-1].is_empty
    assert results["a"] == expected(req)
    assert finish["a"] == (FinishReason.LENGTH, None) and req.status is RequestStatus.FINISHED_LENGTH


def test_budget_and_max_num_seqs_respected() -> None:
    sched, runner = make_scheduler(budget=16, max_num_seqs=3), FakeRunner(4)
    reqs = [make_request(f"r{i}", 5 + i, max_tokens=4 + i % 3) for i in range(7)]
    results, _, outs = run_all(sched, runner, {0: reqs})
    assert max(len(o.num_scheduled_tokens) for o in outs) == 3
    assert max(o.total_num_scheduled_tokens for o in outs) == 16
    assert all(results[r.request_id] == expected(r) for r in reqs)


def test_chunked_prefill_mixes_with_decodes() -> None:
    sched, runner = make_scheduler(budget=8), FakeRunner(4)
    short, long = make_request("short", 3, max_tokens=6), make_request("long", 20, max_tokens=2)
    results, _, outs = run_all(sched, runner, {0: [short], 1: [long]})
    assert outs[0].num_scheduled_tokens == {"short": 3}
    # Decode first (cached), then the long prompt's chunks fill the rest of the budget.
    assert outs[1].num_scheduled_tokens == {"short": 1, "long": 7}
    assert outs[2].num_scheduled_tokens == {"short": 1, "long": 7}
    assert outs[3].num_scheduled_tokens == {"short": 1, "long": 6}
    assert outs[4].num_scheduled_tokens == {"short": 1, "long": 1}
    assert results["long"] == expected(long) and results["short"] == expected(short)


def test_no_chunked_prefill_schedules_whole_prompts_only() -> None:
    sched, runner = make_scheduler(budget=64, max_model_len=64, chunked=False), FakeRunner(4)
    reqs = [make_request("a", 40, max_tokens=2), make_request("b", 30, max_tokens=2)]
    results, _, outs = run_all(sched, runner, {0: reqs})
    assert outs[0].num_scheduled_tokens == {"a": 40}  # b does not fit the remaining 24
    assert outs[1].num_scheduled_tokens == {"a": 1, "b": 30}
    assert all(results[r.request_id] == expected(r) for r in reqs)


@pytest.mark.parametrize("num_blocks", [8, 10, 12])
def test_preemption_gives_same_tokens_as_large_pool(num_blocks: int) -> None:
    def requests() -> list[Request]:
        return [make_request(f"r{i}", 6 + 3 * i, max_tokens=12) for i in range(4)]

    big, _, _ = run_all(make_scheduler(num_blocks=200, budget=16), FakeRunner(4), {0: requests()})
    small = make_scheduler(num_blocks=num_blocks, budget=16)
    reqs = requests()
    results, finish, outs = run_all(small, FakeRunner(4), {0: reqs})
    assert small.num_preemptions > 0
    assert sum(len(o.preempted_req_ids) for o in outs) == small.num_preemptions
    assert results == big and all(results[r.request_id] == expected(r) for r in reqs)
    assert all(reason == (FinishReason.LENGTH, None) for reason in finish.values())


def test_newest_request_preempts_itself() -> None:
    sched, runner = make_scheduler(num_blocks=5, block_size=4), FakeRunner(4)  # 4 usable
    a, b = make_request("a", 6, max_tokens=4), make_request("b", 8, max_tokens=4)
    results, _, outs = run_all(sched, runner, {0: [a, b]})
    # Step 0 fills the pool (2 + 2 blocks). Step 1: a's position 6 fits its block 2, b's
    # position 8 needs a fifth block; b is the newest, so it preempts itself.
    assert outs[1].preempted_req_ids == ["b"] and outs[1].num_scheduled_tokens == {"a": 1}
    assert b.num_preemptions == 1 and a.num_preemptions == 0 and sched.num_preemptions == 1
    resumed = [n for o in outs for n in o.scheduled_new_reqs if n.req_id == "b"][-1]
    assert resumed.num_computed_tokens == 0 and len(resumed.block_ids) == 3
    assert resumed.prefill_token_ids == b.prompt_token_ids + results["b"][:1]
    assert results["a"] == expected(a) and results["b"] == expected(b)


def test_preempts_newest_and_resumes_it_before_later_arrivals() -> None:
    sched, runner = make_scheduler(num_blocks=7, block_size=4), FakeRunner(4)  # 6 usable
    a, b, c = (make_request(n, p, max_tokens=4) for n, p in (("a", 8), ("b", 6), ("c", 6)))
    d = make_request("d", 2, max_tokens=4)
    results, _, outs = run_all(sched, runner, {0: [a, b, c], 1: [d]})
    # Step 1: a's position 8 needs a block; the newest running request (c) is preempted.
    assert outs[1].preempted_req_ids == ["c"] and outs[1].num_scheduled_tokens == {"a": 1, "b": 1}
    # c re-enters at the front of the queue: d, which arrived before the preemption but
    # after c, is never admitted ahead of it.
    order = [n.req_id for o in outs[2:] for n in o.scheduled_new_reqs]
    assert order == ["c", "d"]
    assert all(results[r.request_id] == expected(r) for r in (a, b, c, d))


def eos_at(position: int, token: int = EOS) -> TokenFn:
    return lambda rid, pos: token if pos == position else token_for(rid, pos)


@pytest.mark.parametrize("params, fn, n_out, reason", [
    ({}, eos_at(6), 3, (FinishReason.STOP, None)),
    ({"ignore_eos": True}, eos_at(6), 8, (FinishReason.LENGTH, None)),
    ({"min_tokens": 4}, eos_at(6), 8, (FinishReason.LENGTH, None)),  # EOS was 3rd: too early
    ({"min_tokens": 3}, eos_at(6), 3, (FinishReason.STOP, None)),
    ({"stop_token_ids": [77]}, eos_at(5, 77), 2, (FinishReason.STOP, 77)),
    ({"stop_token_ids": [77], "min_tokens": 2}, eos_at(4, 77), 8, (FinishReason.LENGTH, None)),
    ({}, eos_at(11), 8, (FinishReason.LENGTH, None)),  # max_tokens wins over a final EOS
])
def test_stop_conditions(params: dict, fn: TokenFn, n_out: int, reason: tuple) -> None:
    sched, runner = make_scheduler(), FakeRunner(4, token_fn=fn)
    req = make_request("r", 4, max_tokens=8, **params)
    results, finish, _ = run_all(sched, runner, {0: [req]})
    assert len(results["r"]) == n_out and finish["r"] == reason
    assert req.stop_reason == reason[1]


def test_max_model_len_caps_generation() -> None:
    sched, runner = make_scheduler(max_model_len=16), FakeRunner(4)
    req = make_request("r", 10, max_tokens=None, max_model_len=16)
    assert req.max_tokens == 6
    results, finish, _ = run_all(sched, runner, {0: [req]})
    assert len(results["r"]) == 6 and finish["r"] == (FinishReason.LENGTH, None)
    capped = make_request("s", 10, max_tokens=50, max_model_len=16)  # user max beyond context
    results, finish, _ = run_all(make_scheduler(max_model_len=16), FakeRunner(4), {0: [capped]})
    assert len(results["s"]) == 6 and finish["s"] == (FinishReason.LENGTH, None)


def test_abort_running_and_waiting() -> None:
    sched, runner = make_scheduler(max_num_seqs=1), FakeRunner(4)
    a, b = make_request("a", 9, max_tokens=20), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    results, finish = defaultdict(list), {}
    out = sched.schedule()  # a runs, b waits (max_num_seqs=1)
    mro = runner.execute(out)
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    assert sched.update_from_output(out, mro) == []  # a's token arrives after its abort
    assert a.status is b.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv_cache_manager.num_free_blocks == 63 and not sched.has_unfinished_requests()
    out = step(sched, runner, results, finish)
    assert sorted(out.finished_req_ids) == ["a", "b"]
    assert step(sched, runner, results, finish).finished_req_ids == []
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_add_request_guards() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=32)  # 16 tokens of KV
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 32, max_model_len=32))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("big", 17))
    with pytest.raises(ValueError, match="KV blocks"):  # prompt fits, its whole life does not
        sched.add_request(make_request("grows", 12, max_tokens=6))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", 0))
    sched.add_request(make_request("ok", 12, max_tokens=5))  # 16 tokens ever get KV
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("ok", 3))
    assert sched.get_num_unfinished_requests() == 1


@settings(max_examples=50, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 8]),
       max_model_len=st.integers(8, 64), chunked=st.booleans(),
       max_num_seqs=st.integers(1, 6))
def test_random_workloads_keep_invariants(data: st.DataObject, block_size: int,
                                          max_model_len: int, chunked: bool,
                                          max_num_seqs: int) -> None:
    budget = data.draw(st.integers(1, 64) if chunked else st.integers(max_model_len, 96))
    specs = data.draw(st.lists(st.tuples(st.integers(1, max_model_len - 1), st.integers(1, 20),
                                         st.integers(0, 6)), min_size=1, max_size=8))
    need = max(-(-(min(p + m, max_model_len) - 1) // block_size) for p, m, _ in specs)
    num_blocks = 1 + need + data.draw(st.integers(0, 3 * need))
    sched = make_scheduler(num_blocks, block_size, budget, max_num_seqs, max_model_len, chunked)
    reqs = [make_request(f"r{i}", p, m, max_model_len) for i, (p, m, _) in enumerate(specs)]
    arrivals: dict[int, list[Request]] = defaultdict(list)
    for req, (_, _, at) in zip(reqs, specs):
        arrivals[at].append(req)
    results, finish, _ = run_all(sched, FakeRunner(block_size), arrivals)
    for req in reqs:
        n = min(req.max_tokens, max_model_len - req.num_prompt_tokens)
        assert results[req.request_id] == expected(req)[:n]
        assert finish[req.request_id] == (FinishReason.LENGTH, None)
