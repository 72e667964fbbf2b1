"""EngineCore: the step loop around a real scheduler and an in-process executor."""

from __future__ import annotations

import pytest

from mrv2.core.engine_core import EngineCore
from mrv2.engine.arg_utils import EngineArgs
from mrv2.protocol import EngineCoreOutputs, EngineCoreRequest, FinishReason
from mrv2.sampling_params import SamplingParams

PROMPT_A = [5, 17, 300, 42, 1000, 7, 8]
PROMPT_B = [900, 33, 12, 1500, 64]


@pytest.fixture(scope="module")
def config(tiny_llama):
    # Synchronous: one step in, one step out. Async scheduling has its own tests below.
    return EngineArgs(model=str(tiny_llama), max_model_len=128, max_num_seqs=4, block_size=16,
                      device="cpu", async_scheduling=False).create_engine_config()


@pytest.fixture
def core(config):
    engine = EngineCore(config)
    yield engine
    engine.shutdown()


def request(req_id: str, prompt: list[int], eos: int | None = None,
            **params) -> EngineCoreRequest:
    params = {"temperature": 0.0, "max_tokens": 4, **params}
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(**params), eos_token_id=eos,
                             arrival_time=0.0)


def run_to_completion(core: EngineCore, max_steps: int = 100) -> list[EngineCoreOutputs]:
    steps = []
    while core.has_unfinished_requests():
        steps.append(core.step())
        assert len(steps) < max_steps
    return steps


def num_active(core: EngineCore) -> int:
    return core.executor.worker.runner.requests.num_active


def num_active_after_flush(core: EngineCore) -> int:
    """Runner slots in use after the loop: has_unfinished_requests() stays true until the
    finished ids reached the runner, so run_to_completion already flushed them."""
    assert not core.has_unfinished_requests()
    return num_active(core)


def test_steps_to_completion(core):
    core.add_request(request("a", PROMPT_A, max_tokens=3))
    core.add_request(request("b", PROMPT_B, max_tokens=5))
    assert core.has_unfinished_requests()
    steps = run_to_completion(core)
    # Five sampling steps, then one idle step that carries the finished ids to the runner.
    assert len(steps) == 6 and steps[-1].outputs == []
    steps = steps[:5]
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finished = {}
    for i, step in enumerate(steps):
        assert isinstance(step, EngineCoreOutputs)
        assert step.timestamp > 0
        for out in step.outputs:
            assert len(out.new_token_ids) == 1
            assert out.request_id not in finished  # nothing after the final output
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = (i, out.finish_reason, out.stop_reason)
    assert [len(tokens["a"]), len(tokens["b"])] == [3, 5]
    assert finished == {"a": (2, FinishReason.LENGTH, None), "b": (4, FinishReason.LENGTH, None)}
    assert [[o.request_id for o in s.outputs] for s in steps] == \
        [["a", "b"]] * 3 + [["b"]] * 2
    assert [s.timestamp for s in steps] == sorted(s.timestamp for s in steps)
    # The step after the last output carries the finished ids and frees the runner slots.
    assert num_active_after_flush(core) == 0
    assert core.step().outputs == []


def test_loop_until_no_unfinished_leaves_no_runner_slot_held(core):
    core.add_request(request("a", PROMPT_A, max_tokens=2))
    run_to_completion(core)
    assert num_active(core) == 0


def test_stop_token_and_eos(core):
    core.add_request(request("ref", PROMPT_A, max_tokens=3, ignore_eos=True))
    ref = [o.new_token_ids[0] for s in run_to_completion(core) for o in s.outputs]
    assert len(ref) == 3 and ref[0] != ref[1]

    core.add_request(request("stop", PROMPT_A, max_tokens=3, stop_token_ids=[ref[1]]))
    core.add_request(request("eos", PROMPT_A, eos=ref[1], max_tokens=3))
    outs = {}
    for step in run_to_completion(core):
        for out in step.outputs:
            outs.setdefault(out.request_id, []).append(out)
    for req_id, stop_reason in (("stop", ref[1]), ("eos", None)):
        last = outs[req_id][-1]
        assert [o.new_token_ids[0] for o in outs[req_id]] == ref[:2]
        assert last.finish_reason == FinishReason.STOP and str(last.finish_reason) == "stop"
        assert last.stop_reason == stop_reason


def test_abort_running_requests_frees_runner_slots(core):
    core.add_request(request("a", PROMPT_A, max_tokens=10))
    core.add_request(request("b", PROMPT_B, max_tokens=10))
    core.step()
    assert num_active(core) == 2
    core.abort_requests(["a", "b"])
    # The finished ids still have to reach the runner: that is unfinished work.
    assert core.has_unfinished_requests()
    # Nothing is scheduled, but the step still carries the finished ids to the runner.
    assert core.step().outputs == []
    assert num_active(core) == 0
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.usage == 0


def test_abort_one_running_request_keeps_the_other(core):
    core.add_request(request("a", PROMPT_A, max_tokens=4))
    core.add_request(request("b", PROMPT_B, max_tokens=4))
    core.step()
    core.abort_requests(["a", "unknown-id"])
    steps = run_to_completion(core)
    ids = {o.request_id for s in steps for o in s.outputs}
    assert ids == {"b"}
    assert sum(len(o.new_token_ids) for s in steps for o in s.outputs) == 3
    assert num_active_after_flush(core) == 0


def test_abort_waiting_request(core):
    core.add_request(request("a", PROMPT_A, max_tokens=3))
    core.step()
    core.add_request(request("w", PROMPT_B, max_tokens=3))  # waiting: not scheduled yet
    assert core.scheduler.num_waiting == 1
    core.abort_requests(["w"])
    assert core.scheduler.num_waiting == 0
    steps = run_to_completion(core)
    assert {o.request_id for s in steps for o in s.outputs} == {"a"}
    assert num_active_after_flush(core) == 0

    # Aborted before any step at all.
    core.add_request(request("x", PROMPT_B))
    core.abort_requests(["x"])
    assert core.step().outputs == []
    assert not core.has_unfinished_requests()
    assert num_active(core) == 0


def test_idle_step_skips_the_executor(core, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the executor was called with nothing to do")

    monkeypatch.setattr(core.executor, "execute_model", boom)
    assert core.step().outputs == []


def test_duplicate_request_id_refused(core):
    core.add_request(request("a", PROMPT_A))
    with pytest.raises(ValueError, match="'a'"):
        core.add_request(request("a", PROMPT_B))
    steps = run_to_completion(core)
    assert sum(len(o.new_token_ids) for s in steps for o in s.outputs) == 4


@pytest.fixture
def async_core(tiny_llama):
    config = EngineArgs(model=str(tiny_llama), max_model_len=128, max_num_seqs=4, block_size=16,
                        device="cpu", async_scheduling=True).create_engine_config()
    engine = EngineCore(config)
    yield engine
    engine.shutdown()


def tokens_by_request(steps: list[EngineCoreOutputs]) -> dict[str, tuple[list[int], object]]:
    result: dict[str, tuple[list[int], object]] = {}
    for step in steps:
        for out in step.outputs:
            tokens, _ = result.get(out.request_id, ([], None))
            assert out.request_id not in result or result[out.request_id][1] is None, \
                "output after the final one"
            result[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    return result


def test_async_scheduling_keeps_two_steps_in_flight_and_matches_sync(core, async_core):
    ref_tokens = None
    for engine in (core, async_core):
        engine.add_request(request("ref", PROMPT_A, max_tokens=6, ignore_eos=True))
        ref = tokens_by_request(run_to_completion(engine))["ref"][0]
        ref_tokens = ref_tokens or ref
        assert ref == ref_tokens
    # Stop on a token mid-way: the async core has already scheduled one more step for the
    # request; that step's token is dropped and the request is freed once.
    stop_id = ref_tokens[2]
    results = []
    for engine in (core, async_core):
        engine.add_request(request("stop", PROMPT_A, max_tokens=6, stop_token_ids=[stop_id]))
        engine.add_request(request("len", PROMPT_B, max_tokens=5))
        engine.add_request(request("eos", PROMPT_A, eos=ref_tokens[1], max_tokens=6))
        max_in_flight = 0
        steps = []
        while engine.has_unfinished_requests():
            steps.append(engine.step())
            max_in_flight = max(max_in_flight, len(engine.batch_queue))
        results.append(tokens_by_request(steps))
        # Between steps one step stays queued with async scheduling (two ran during a step).
        assert max_in_flight == engine.max_steps_in_flight - 1
        assert engine.executor.worker.runner.requests.num_active == 0
        assert engine.scheduler.kv_cache_usage == 0
    sync, asynchronous = results
    assert sync == asynchronous
    assert sync["stop"] == (ref_tokens[:ref_tokens.index(stop_id) + 1], FinishReason.STOP)
    assert sync["eos"][0] == ref_tokens[:ref_tokens.index(ref_tokens[1]) + 1]
    assert sync["len"][1] == FinishReason.LENGTH and len(sync["len"][0]) == 5


def test_async_abort_while_a_step_is_in_flight(async_core):
    async_core.add_request(request("a", PROMPT_A, max_tokens=20))
    async_core.add_request(request("b", PROMPT_B, max_tokens=4, ignore_eos=True))
    async_core.step()
    assert len(async_core.batch_queue) == 1
    async_core.abort_requests(["a"])
    result = tokens_by_request(run_to_completion(async_core))
    assert "a" not in result or result["a"][1] is None
    assert len(result["b"][0]) == 4
    assert async_core.executor.worker.runner.requests.num_active == 0
    assert async_core.scheduler.kv_cache_usage == 0


def test_sleep_right_after_the_last_output_flushes_the_lagging_step(tiny_llama):
    """With async scheduling the core still holds a step in flight (and finished ids) when the
    last request's final output comes out: sleep finishes that bookkeeping instead of refusing
    an engine with no request left."""
    config = EngineArgs(model=str(tiny_llama), max_model_len=128, max_num_seqs=4,
                        device="cpu", async_scheduling=True).create_engine_config()
    core = EngineCore(config)
    try:
        core.add_request(request("a", PROMPT_A, max_tokens=3))
        finished = False
        while not finished:
            finished = any(o.finish_reason is not None for o in core.step().outputs)
        assert not core.scheduler.has_unfinished_requests() and core.has_unfinished_requests()
        core.sleep(1)
        assert not core.has_unfinished_requests() and num_active(core) == 0
        core.wake_up()
        core.add_request(request("b", PROMPT_A, max_tokens=3))
        assert len(run_to_completion(core)) >= 3
        with pytest.raises(RuntimeError, match="1 request"):
            core.add_request(request("c", PROMPT_A, max_tokens=3))
            core.sleep(1)
    finally:
        core.shutdown()
