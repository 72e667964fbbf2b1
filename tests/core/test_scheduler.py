"""Scheduler tests, driven by a fake runner that keeps the runner's view of each request.

Tokens are a pure function of (request id, position), so the final sequences must not depend
on batching, chunking, preemption or prefix-cache hits. The fake runner also simulates the KV
cache: each slot holds a fingerprint of the token prefix that produced it, and every scheduled
request must find its whole context intact, so a wrong prefix-cache hit, a shared block written
twice or a block reused while still needed is caught.
"""

from __future__ import annotations

import zlib
from collections import Counter, defaultdict
from collections.abc import Callable

import msgspec
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from mrv2.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mrv2.core.request import Request, RequestStatus
from mrv2.core.scheduler import Scheduler
from mrv2.protocol import FinishReason, ModelRunnerOutput, SchedulerOutput
from mrv2.sampling_params import SamplingParams

EOS = 1
TokenFn = Callable[[str, int], int]


def token_for(req_id: str, position: int) -> int:
    return 100 + zlib.crc32(f"{req_id}:{position}".encode()) % 900  # never EOS


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32,
                   max_num_seqs: int = 8, max_model_len: int = 64,
                   chunked: bool = True, prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig(
        model_config=ModelConfig(model="fake", dtype=torch.float32, max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=budget,
                                         enable_chunked_prefill=chunked))
    return Scheduler(config, num_blocks)


def make_request(req_id: str, prompt_len: int, max_tokens: int | None = 8,
                 max_model_len: int = 64, prefix: list[int] = (),
                 eos_stop_token_ids: tuple[int, ...] = (), **params) -> Request:
    """A prompt of `prompt_len` tokens: `prefix`, then tokens unique to the request."""
    prompt = list(prefix[:prompt_len])
    prompt += [token_for(req_id, p) for p in range(len(prompt), prompt_len)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_id=EOS, max_model_len=max_model_len,
                   eos_stop_token_ids=eos_stop_token_ids)


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
        # Simulated KV: per block, per slot, the fingerprint of the prefix that wrote it.
        self.kv: dict[int, list[int | None]] = defaultdict(lambda: [None] * block_size)
        self.num_computed_total = 0  # tokens actually run, over all steps

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
            (block_ids,) = new.block_ids  # the one KV cache group
            self.blocks[new.req_id] = list(block_ids)
        cached = out.scheduled_cached_reqs
        assert cached.num_kv_groups == 1
        for rid, delta, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens):
            assert self.computed[rid] == num_computed
            (group_delta,) = delta
            self.blocks[rid] += group_delta
        bs = self.block_size
        # Like a forward pass: every scheduled token writes its KV, then every request attends
        # to its whole context (so a request may hit blocks another computes in this step).
        for rid, n in out.num_scheduled_tokens.items():
            start = self.computed[rid]
            assert 0 < n and start + n <= len(self.tokens[rid])
            self.num_computed_total += n
            prints = fingerprints(self.tokens[rid][:start + n])
            for pos in range(start, start + n):
                self.kv[self.blocks[rid][pos // bs]][pos % bs] = prints[pos]
            self.computed[rid] = start + n
        sampled = []
        for rid in out.num_scheduled_tokens:
            num_computed = self.computed[rid]
            # Blocks cover exactly the computed tokens: allocation is never speculative.
            assert len(self.blocks[rid]) == -(-num_computed // bs)
            context = [x for b in self.blocks[rid] for x in self.kv[b]][:num_computed]
            assert context == fingerprints(self.tokens[rid][:num_computed]), rid
            if num_computed == len(self.tokens[rid]):
                self.tokens[rid].append(self.token_fn(rid, len(self.tokens[rid])))
                sampled.append(self.tokens[rid][-1:])
            else:
                sampled.append([])  # mid-prefill chunk: nothing sampled
        index_of: dict[int, int] = {}
        for blocks in self.blocks.values():
            assert 0 not in blocks and len(blocks) == len(set(blocks))
            for i, b in enumerate(blocks):  # a shared block sits at one index in every list
                assert index_of.setdefault(b, i) == i
        return ModelRunnerOutput.build(req_ids=list(out.num_scheduled_tokens),
                                       sampled_token_ids=sampled)

    def _drop(self, rid: str) -> None:
        self.tokens.pop(rid, None)
        self.computed.pop(rid, None)
        self.blocks.pop(rid, None)


def fingerprints(tokens: list[int]) -> list[int]:
    """Per position, a value that depends on every token up to it (what its KV depends on)."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


def step(sched: Scheduler, runner: FakeRunner, results: dict, finish: dict) -> SchedulerOutput:
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert sched.num_running <= sched.max_num_seqs
    assert list(out.num_scheduled_tokens) == (out.scheduled_cached_reqs.req_ids
                                              + [r.req_id for r in out.scheduled_new_reqs])
    mro = runner.execute(out)
    for rid in out.num_scheduled_tokens:  # base list + deltas == the scheduler's list
        assert (runner.blocks[rid],) == sched.kv_cache_manager.get_block_ids(rid)
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
    # Every block came back: free, or cached and evictable (also free).
    assert pool.num_free_blocks == pool.num_blocks - 1 and sched.kv_cache_usage == 0.0
    assert all(pool.ref_count(b) == 0 for b in range(1, pool.num_blocks))
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
    assert [len(g) for g in outs[0].scheduled_new_reqs[0].block_ids] == [3]
    assert outs[1].scheduled_cached_reqs.new_block_ids == [[[]]]  # position 11 is in block 3
    assert [len(g) for g in outs[2].scheduled_cached_reqs.new_block_ids[0]] == [1]  # block 4
    assert outs[-1].finished_req_ids == ["a"] and outs[-1].is_empty
    assert results["a"] == expected(req)
    assert finish["a"] == (FinishReason.LENGTH, None)
    assert req.status is RequestStatus.FINISHED_LENGTH


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


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_newest_request_preempts_itself(prefix_caching: bool) -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, prefix_caching=prefix_caching)
    runner = FakeRunner(4)  # 4 usable blocks
    a, b = make_request("a", 6, max_tokens=4), make_request("b", 8, max_tokens=4)
    results, _, outs = run_all(sched, runner, {0: [a, b]})
    # Step 0 fills the pool (2 + 2 blocks). Step 1: a's position 6 fits its block 2, b's
    # position 8 needs a fifth block; b is the newest, so it preempts itself.
    assert outs[1].preempted_req_ids == ["b"] and outs[1].num_scheduled_tokens == {"a": 1}
    assert b.num_preemptions == 1 and a.num_preemptions == 0 and sched.num_preemptions == 1
    resumed = [n for o in outs for n in o.scheduled_new_reqs if n.req_id == "b"][-1]
    assert resumed.prefill_token_ids == b.prompt_token_ids + results["b"][:1]
    assert [len(g) for g in resumed.block_ids] == [3]
    # b's blocks were freed tail first; a's next block evicted b's block 1, so with prefix
    # caching b resumes with its block 0 still cached and recomputes the other 5 tokens.
    hit = 4 if prefix_caching else 0
    assert resumed.num_computed_tokens == hit
    resume_step = next(o for o in outs if resumed in o.scheduled_new_reqs)
    assert resume_step.num_scheduled_tokens["b"] == 9 - hit
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
    # The model's other EOS ids stop like stop_token_ids, reporting the id (as vLLM).
    ({"eos_stop_token_ids": (55, 66)}, eos_at(5, 66), 2, (FinishReason.STOP, 66)),
    ({"eos_stop_token_ids": (55, 66), "ignore_eos": True}, eos_at(5, 66), 8,
     (FinishReason.LENGTH, None)),
    ({"eos_stop_token_ids": (66,), "min_tokens": 3}, eos_at(5, 66), 8,
     (FinishReason.LENGTH, None)),
    ({"eos_stop_token_ids": (66,), "min_tokens": 2}, eos_at(5, 66), 2,
     (FinishReason.STOP, 66)),
])
def test_stop_conditions(params: dict, fn: TokenFn, n_out: int, reason: tuple) -> None:
    sched, runner = make_scheduler(), FakeRunner(4, token_fn=fn)
    req = make_request("r", 4, max_tokens=8, **params)
    results, finish, _ = run_all(sched, runner, {0: [req]})
    assert len(results["r"]) == n_out and finish["r"] == reason
    assert req.stop_reason == reason[1]


def test_new_request_data_carries_the_primary_eos() -> None:
    """The runner masks the request's own EOS for min_tokens (it may be a tokenizer-only one)."""
    sched = make_scheduler()
    sched.add_request(make_request("r", 4))
    assert [n.eos_token_id for n in sched.schedule().scheduled_new_reqs] == [EOS]


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


def test_nan_logits_end_only_that_request_with_an_error() -> None:
    """A row whose logits held a NaN (the runner names it in nan_req_ids): its token is not
    appended, the request finishes with finish_reason "error" and frees its blocks; the
    other request of the batch carries on."""
    sched, runner = make_scheduler(), FakeRunner(4)
    a, b = make_request("a", 5), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    mro = runner.execute(out)
    bad = msgspec.structs.replace(mro, nan_req_ids=["a"])
    outputs = {o.request_id: o for o in sched.update_from_output(out, bad)}
    assert outputs["a"].finish_reason is FinishReason.ERROR and outputs["a"].new_token_ids == []
    assert a.status is RequestStatus.FINISHED_ERROR and a.output_token_ids == []
    assert outputs["b"].finish_reason is None and len(outputs["b"].new_token_ids) == 1
    assert [r.request_id for r in sched.running] == ["b"]
    assert sched.schedule().finished_req_ids == ["a"]


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
    with pytest.raises(ValueError, match="NUL"):  # step messages pack ids NUL-separated
        sched.add_request(make_request("bad\0id", 3))
    assert sched.get_num_unfinished_requests() == 1


FAMILIES = [[token_for(f"family{f}", p) for p in range(64)] for f in range(3)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 8]),
       max_model_len=st.integers(8, 64), chunked=st.booleans(),
       max_num_seqs=st.integers(1, 6), prefix_caching=st.booleans())
def test_random_workloads_keep_invariants(data: st.DataObject, block_size: int,
                                          max_model_len: int, chunked: bool,
                                          max_num_seqs: int, prefix_caching: bool) -> None:
    budget = data.draw(st.integers(1, 64) if chunked else st.integers(max_model_len, 96))
    # (prompt len, max tokens, arrival step, prefix family, tokens shared with the family)
    specs = data.draw(st.lists(st.tuples(st.integers(1, max_model_len - 1), st.integers(1, 20),
                                         st.integers(0, 6), st.integers(0, 2),
                                         st.integers(0, 64)), min_size=1, max_size=8))
    need = max(-(-(min(p + m, max_model_len) - 1) // block_size) for p, m, *_ in specs)
    num_blocks = 1 + need + data.draw(st.integers(0, 3 * need))
    sched = make_scheduler(num_blocks, block_size, budget, max_num_seqs, max_model_len, chunked,
                           prefix_caching)
    reqs = [make_request(f"r{i}", p, m, max_model_len, prefix=FAMILIES[f][:shared])
            for i, (p, m, _, f, shared) in enumerate(specs)]
    arrivals: dict[int, list[Request]] = defaultdict(list)
    for req, (_, _, at, *_) in zip(reqs, specs):
        arrivals[at].append(req)
    results, finish, _ = run_all(sched, FakeRunner(block_size), arrivals)
    event(f"prefix hits: {sched.prefix_cache_stats.hits > 0}, "
          f"preempted: {sched.num_preemptions > 0}")
    for req in reqs:
        n = min(req.max_tokens, max_model_len - req.num_prompt_tokens)
        assert results[req.request_id] == expected(req)[:n]
        assert finish[req.request_id] == (FinishReason.LENGTH, None)


# -- prefix caching ---------------------------------------------------------------------------

PREFIX = [token_for("shared", p) for p in range(64)]


def admission(outs: list[SchedulerOutput], req_id: str, nth: int = 0):
    """The `nth` step that admitted `req_id` (as a new request): (NewRequestData, output)."""
    found = [(n, o) for o in outs for n in o.scheduled_new_reqs if n.req_id == req_id]
    return found[nth]


@pytest.mark.parametrize("prompt_len", [8, 11, 12])
@pytest.mark.parametrize("together", [False, True])
def test_same_prompt_twice_second_computes_only_the_tail(prompt_len: int,
                                                         together: bool) -> None:
    sched, runner = make_scheduler(block_size=4), FakeRunner(4)
    a, b = (make_request(r, prompt_len, max_tokens=3, prefix=PREFIX) for r in "ab")
    assert a.prompt_token_ids == b.prompt_token_ids
    # Either b arrives after a finished (a's blocks are cached and free), or in the same step
    # (b hits the blocks a computes in that very step).
    results, _, outs = run_all(sched, runner, {0: [a, b]} if together else {0: [a], 5: [b]})
    hit = (prompt_len - 1) // 4 * 4  # full blocks, never the last token
    a_new, _ = admission(outs, "a")
    b_new, b_out = admission(outs, "b")
    assert b_new.num_computed_tokens == hit
    assert b_new.block_ids[0][:hit // 4] == a_new.block_ids[0][:hit // 4]
    assert b_out.num_scheduled_tokens["b"] == prompt_len - hit
    assert runner.num_computed_total == 2 * prompt_len - hit + 2 * 2  # + 2 decodes each
    stats = sched.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 2 * prompt_len, hit)
    assert results["a"] == expected(a) and results["b"] == expected(b)
    stats.reset()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_same_step_hits_share_blocks_with_ref_counts() -> None:
    sched, runner = make_scheduler(block_size=4), FakeRunner(4)
    a, b = (make_request(r, 10, max_tokens=3, prefix=PREFIX) for r in "ab")
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10, "b": 2}
    (a_blocks,), (b_blocks,) = (sched.kv_cache_manager.get_block_ids(r) for r in "ab")
    assert a_blocks[:2] == b_blocks[:2] and a_blocks[2] != b_blocks[2]
    pool = sched.kv_cache_manager.block_pool
    assert [pool.ref_count(x) for x in a_blocks] == [2, 2, 1]
    results, finish = defaultdict(list), {}
    for o in sched.update_from_output(out, runner.execute(out)):
        results[o.request_id] += o.new_token_ids
    # Aborting one sharer drops its references only; the other runs on unharmed.
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert [pool.ref_count(x) for x in a_blocks] == [1, 1, 0]
    while sched.has_unfinished_requests() or sched.has_finished_requests():
        step(sched, runner, results, finish)
    assert results["b"] == expected(b) and finish == {"b": (FinishReason.LENGTH, None)}
    assert runner.finished_seen == Counter("ab")
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert all(pool.ref_count(x) == 0 for x in range(1, pool.num_blocks))


def test_prompts_sharing_a_long_prefix() -> None:
    sched, runner = make_scheduler(block_size=4, budget=64), FakeRunner(4)
    suffixes = [3, 7, 12, 1]
    reqs = [make_request(f"r{i}", 32 + n, max_tokens=4, prefix=PREFIX[:32])
            for i, n in enumerate(suffixes)]
    results, _, outs = run_all(sched, runner, {0: reqs})
    # One step: r0 computes its whole prompt, the others only their suffixes.
    assert outs[0].num_scheduled_tokens == {"r0": 35, "r1": 7, "r2": 12, "r3": 1}
    assert [n.num_computed_tokens for n in outs[0].scheduled_new_reqs] == [0, 32, 32, 32]
    stats = sched.prefix_cache_stats
    assert (stats.queries, stats.hits) == (sum(32 + n for n in suffixes), 3 * 32)
    assert all(results[r.request_id] == expected(r) for r in reqs)


def test_caching_off_recomputes_everything() -> None:
    sched, runner = make_scheduler(block_size=4, prefix_caching=False), FakeRunner(4)
    a, b = (make_request(r, 11, max_tokens=3, prefix=PREFIX) for r in "ab")
    results, _, outs = run_all(sched, runner, {0: [a], 5: [b]})
    assert admission(outs, "b")[0].num_computed_tokens == 0
    assert runner.num_computed_total == 2 * (11 + 2)
    stats = sched.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    assert sched.kv_cache_manager.block_pool.num_cached_blocks == 0
    assert results["b"] == expected(b)


@pytest.mark.parametrize("num_blocks", [12, 14, 18])
def test_preemption_with_prefix_caching_gives_same_tokens(num_blocks: int) -> None:
    def requests() -> list[Request]:
        return [make_request(f"r{i}", 12 + 3 * i, max_tokens=14, prefix=PREFIX[:10 + 2 * i])
                for i in range(5)]

    big = make_scheduler(num_blocks=200, budget=16, prefix_caching=False)
    want, _, _ = run_all(big, FakeRunner(4), {0: requests()})
    small = make_scheduler(num_blocks=num_blocks, budget=16)
    reqs = requests()
    results, _, outs = run_all(small, FakeRunner(4), {0: reqs[:3], 2: reqs[3:]})
    assert small.num_preemptions > 0
    assert results == want and all(results[r.request_id] == expected(r) for r in reqs)
    stats = small.prefix_cache_stats
    assert stats.hits > 0 and stats.requests == 5 + small.num_preemptions
    # Resumed requests (prompt + outputs) hit the cache as well.
    resumed = [n for o in outs for n in o.scheduled_new_reqs
               if len(n.prefill_token_ids) > len(n.prompt_token_ids)]
    assert resumed and any(n.num_computed_tokens > 0 for n in resumed)
