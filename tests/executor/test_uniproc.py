"""UniProcExecutor (and the Executor base): start-up, collective calls, the two-phase step with
futures, and a SchedulerOutput that survives the msgpack trip a multiprocess executor makes."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import msgspec
import pytest

# mrv2 before executor: importing executor first is circular (see test_import_executor_first).
from mrv2.engine.arg_utils import EngineArgs  # isort: skip
from executor.base import Executor  # isort: skip
from executor.uniproc import UniProcExecutor  # isort: skip
from mrv2.protocol import (CachedRequestData, GrammarOutput, ModelRunnerOutput, NewRequestData,
                           SchedulerOutput)
from mrv2.sampling_params import SamplingParams

PROMPTS = {"a": [5, 17, 300, 42, 1000, 7, 8], "b": [900, 33, 12, 1500, 64]}


@pytest.fixture(scope="module")
def config(tiny_llama):
    return EngineArgs(model=str(tiny_llama), max_model_len=64, max_num_seqs=4, block_size=16,
                      device="cpu").create_engine_config()


@pytest.fixture
def executor(config) -> UniProcExecutor:
    ex = UniProcExecutor(config)
    ex.initialize()
    yield ex
    ex.shutdown()


def prefill(params: dict[str, SamplingParams] | None = None) -> SchedulerOutput:
    params = params or {}
    new = [NewRequestData(req_id=r, prompt_token_ids=p, prefill_token_ids=p,
                          sampling_params=params.get(r, SamplingParams(temperature=0.0)),
                          block_ids=[[i + 1]], num_computed_tokens=0)
           for i, (r, p) in enumerate(PROMPTS.items())]
    num = {r: len(p) for r, p in PROMPTS.items()}
    return SchedulerOutput.build(scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(),
                           num_scheduled_tokens=num, total_num_scheduled_tokens=sum(num.values()))


def decode(i: int, finished: list[str] = ()) -> SchedulerOutput:
    ids = [r for r in PROMPTS if r not in finished]
    return SchedulerOutput.build(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.build(
            req_ids=ids, new_block_ids=[[[]] for _ in ids],
            num_computed_tokens=[len(PROMPTS[r]) + i for r in ids]),
        num_scheduled_tokens={r: 1 for r in ids}, total_num_scheduled_tokens=len(ids),
        finished_req_ids=list(finished))


def test_import_executor_first():
    # A worker process (or a user) may import the executor package before mrv2.
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", "import executor.uniproc"], cwd=root,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_initialize_returns_block_count(config):
    ex = UniProcExecutor(config)
    assert isinstance(ex, Executor)
    num_blocks = ex.initialize()
    # 4 seqs * 4 blocks of a 64-token request + the null block (the CPU budget is far larger).
    assert num_blocks == 4 * 4 + 1
    assert ex.num_kv_blocks == ex.worker.num_kv_blocks == num_blocks
    assert ex.worker.runner.kv_caches[0].shape[1] == num_blocks
    ex.shutdown()
    ex.shutdown()  # idempotent


def test_collective_rpc_returns_one_result_per_worker(executor):
    assert executor.collective_rpc("determine_num_kv_blocks") == [executor.num_kv_blocks]
    # Phase 2 needs a pending phase 1; through collective_rpc the error reaches the caller.
    with pytest.raises(RuntimeError, match="without a pending execute_model"):
        executor.collective_rpc("sample_tokens", (None,))
    empty = SchedulerOutput.build([], CachedRequestData(), {}, 0)
    assert executor.collective_rpc("execute_model", (empty,)) == [None]
    assert executor.collective_rpc("sample_tokens", (None,)) == [
        ModelRunnerOutput.build(req_ids=[], sampled_token_ids=[])]


def test_blocking_step(executor):
    assert executor.execute_model(prefill()) is None
    out = executor.sample_tokens(GrammarOutput())
    assert isinstance(out, ModelRunnerOutput)
    assert out.req_ids == ["a", "b"] and all(len(t) == 1 for t in out.sampled_token_ids)


def test_non_block_futures_complete_with_the_blocking_results(executor):
    """Phase 1's future is done at once; phase 2's completes when the output copy has been
    resolved (on the executor's reply thread), with what a blocking call returns."""
    blocking = UniProcExecutor(executor.config)
    blocking.initialize()
    blocking.execute_model(prefill())
    expected = blocking.sample_tokens(None)

    fut = executor.execute_model(prefill(), non_block=True)
    assert isinstance(fut, Future) and fut.done() and fut.result() is None
    fut = executor.sample_tokens(GrammarOutput(), non_block=True)
    assert isinstance(fut, Future)
    assert fut.result(timeout=10.0) == expected


def test_exception_surfaces_through_future(executor):
    executor.execute_model(prefill())
    # Phase 1 twice without phase 2 is an error inside the runner.
    fut = executor.execute_model(decode(0), non_block=True)
    assert fut.done()
    assert isinstance(fut.exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="twice"):
        fut.result()
    # Blocking mode raises directly.
    with pytest.raises(RuntimeError, match="twice"):
        executor.execute_model(decode(0))
    # The executor stays usable: the pending phase 2 still completes.
    assert executor.sample_tokens(None, non_block=True).result().req_ids == ["a", "b"]


def test_scheduler_output_round_trips_through_msgpack(config):
    """What a multiprocess executor sends survives encode/decode, and a runner fed the decoded
    copy produces exactly the outputs of one fed the original."""
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    out_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
    direct, remote = UniProcExecutor(config), UniProcExecutor(config)
    direct.initialize()
    remote.initialize()
    params = {"a": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=123,
                                  stop_token_ids=[3], max_tokens=10),
              "b": SamplingParams(temperature=1.0, min_p=0.05)}
    steps = [prefill(params), decode(0), decode(1), decode(2, finished=["a"])]
    for sched in steps:
        copy = decoder.decode(encoder.encode(sched))
        assert copy == sched
        assert list(copy.num_scheduled_tokens) == list(sched.num_scheduled_tokens)  # batch order
        assert [n.sampling_params for n in copy.scheduled_new_reqs] == \
            [n.sampling_params for n in sched.scheduled_new_reqs]
        direct.execute_model(sched)
        remote.execute_model(copy)
        want = direct.sample_tokens(GrammarOutput())
        got = out_decoder.decode(encoder.encode(remote.sample_tokens(GrammarOutput())))
        assert got == want
    assert remote.worker.runner.requests.num_active == 1
