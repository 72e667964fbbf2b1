"""MultiprocExecutor: same greedy tokens as the in-process executor, the two-phase RPC with
futures, collective calls, fail-fast when a worker dies, start-up errors with the worker's
traceback, workers that follow a dead parent, and nothing left behind after shutdown.

Each executor start spawns a process that imports torch (seconds): one executor is shared by
the module, and only the failure tests start their own."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import operator
import os
import pickle
import shutil
import signal
import threading
import time
from concurrent.futures import Future

import pytest

from mrv2.engine.arg_utils import EngineArgs  # isort: skip
from executor.multiproc import MultiprocExecutor  # isort: skip
from mrv2.core.engine_core import EngineCore
from mrv2.errors import EngineDeadError, WorkerError, WorkerStartupError
from mrv2.protocol import EngineCoreOutputs, EngineCoreRequest, GrammarOutput, ModelRunnerOutput
from mrv2.sampling_params import SamplingParams
from mrv2.testing.leftovers import (engine_leftovers, lasting_engine_entries,
                                    new_engine_entries, process_alive)

from executor_helpers import is_failed, shm_names, worker_pids

PROMPTS = {"a": [5, 17, 300, 42, 1000, 7, 8], "b": [900, 33, 12, 1500, 64],
           "c": [1, 2, 3], "d": list(range(100, 140))}
MAX_TOKENS = {"a": 12, "b": 5, "c": 20, "d": 9}
# Stopping a worker that ignores the shutdown message: terminate after a grace, then kill.
_STOP_BUDGET_S = 6.0


@pytest.fixture(scope="module")
def config(tiny_llama):
    return EngineArgs(model=str(tiny_llama), max_model_len=128).create_engine_config()


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def assert_nothing_left(executor: MultiprocExecutor, shm_before: set[str]) -> None:
    left = engine_leftovers(worker_pids(executor), shm_names(executor), shm_before)
    assert not left, f"left behind: {left}"


class Engines:
    """One EngineCore + MultiprocExecutor shared by the module. A test that breaks it takes it
    with `take()` (a fresh one is started if it is already broken or taken)."""

    def __init__(self, config) -> None:
        self.config, self.started, self._shared = config, [], None

    def shared(self) -> EngineCore:
        if self._shared is None or is_failed(self._shared.executor):
            self._shared = EngineCore(self.config, executor_class=MultiprocExecutor)
            self.started.append(self._shared)
        return self._shared

    def take(self) -> EngineCore:
        core = self.shared()
        self._shared = None
        return core


@pytest.fixture(scope="module")
def engines(config):
    before = shm_entries()
    engines = Engines(config)
    yield engines
    for core in engines.started:
        core.shutdown()
        core.shutdown()  # idempotent
        assert_nothing_left(core.executor, before)


@pytest.fixture
def engine(engines) -> EngineCore:
    return engines.shared()


def add_requests(core: EngineCore, prefix: str = "") -> None:
    for req_id, prompt in PROMPTS.items():
        core.add_request(EngineCoreRequest(
            request_id=prefix + req_id, prompt_token_ids=prompt, eos_token_id=None,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[req_id],
                                           ignore_eos=True), arrival_time=0.0))


def collect(core: EngineCore, step) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def reference(config) -> dict[str, list[int]]:
    core = EngineCore(config)  # UniProcExecutor
    add_requests(core)
    tokens = collect(core, core.step)
    core.shutdown()
    assert {r: len(t) for r, t in tokens.items()} == MAX_TOKENS
    return tokens


def test_greedy_tokens_match_in_process_executor(engine, reference):
    add_requests(engine)
    assert collect(engine, engine.step) == reference
    add_requests(engine, prefix="again-")  # a second batch, prefix cache warm
    again = collect(engine, engine.step)
    assert {r.removeprefix("again-"): t for r, t in again.items()} == reference


def test_two_phase_step_with_futures(engine, reference, monkeypatch):
    ex = engine.executor

    def step():
        sched = engine.scheduler.schedule()
        phase1 = ex.execute_model(sched, non_block=True)
        phase2 = ex.sample_tokens(GrammarOutput(), non_block=True)  # sent before phase 1 ends
        assert isinstance(phase1, Future) and isinstance(phase2, Future)
        out = phase2.result(timeout=30)
        assert isinstance(out, ModelRunnerOutput)
        assert phase1.done() and phase1.result() is None
        return EngineCoreOutputs(outputs=engine.scheduler.update_from_output(sched, out))

    add_requests(engine, prefix="fut-")
    with monkeypatch.context() as patched:  # nothing on the step path is pickled
        for name in ("dumps", "loads", "dump", "load"):
            patched.setattr(pickle, name, _no_pickle)
        tokens = collect(engine, step)
    assert {r.removeprefix("fut-"): t for r, t in tokens.items()} == reference


def _no_pickle(*args, **kwargs):
    raise AssertionError("pickle used on the step path")


def test_collective_rpc(engine):
    ex = engine.executor
    assert ex.collective_rpc("determine_num_kv_blocks", timeout=30) == [ex.num_kv_blocks]
    assert ex.collective_rpc(operator.attrgetter("num_kv_blocks")) == [ex.num_kv_blocks]
    # A worker's exception arrives as the same type, with the worker's traceback attached.
    with pytest.raises(RuntimeError, match="without a pending execute_model") as info:
        ex.collective_rpc("sample_tokens", (None,))
    assert "Traceback" in info.value.remote_traceback
    with pytest.raises(AttributeError, match="no_such_method"):
        ex.collective_rpc("no_such_method")
    with pytest.raises(AttributeError, match="private"):
        ex.collective_rpc("_secret")
    # Phase 2 with nothing pending, non-blocking: the error comes through the future.
    future = ex.sample_tokens(None, non_block=True)
    assert isinstance(future.exception(timeout=30), RuntimeError)
    assert not is_failed(ex)


def test_worker_heap_is_frozen_after_startup(engine):
    # Worker processes hold one engine for life: initialize froze their startup objects
    # (executor/heap.py); the parent, which builds many engines in this test run, is not frozen.
    from executor_helpers import frozen_object_count

    assert all(n > 1000 for n in engine.executor.collective_rpc(frozen_object_count))
    assert frozen_object_count() == 0


def test_rpc_timeout_then_late_reply_is_matched(engine):
    ex = engine.executor
    (pid,) = worker_pids(ex)
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError, match="determine_num_kv_blocks"):
            ex.collective_rpc("determine_num_kv_blocks", timeout=0.3)
    finally:
        os.kill(pid, signal.SIGCONT)
    # The late reply belongs to the timed-out call; this call gets its own.
    assert ex.collective_rpc(operator.attrgetter("num_kv_blocks"), timeout=30) == \
        [ex.num_kv_blocks]


def test_killed_worker_fails_pending_and_later_calls_fast(engines):
    before = shm_entries()
    core = engines.take()
    ex = core.executor
    (pid,) = worker_pids(ex)
    try:
        add_requests(core)
        for _ in range(3):
            core.step()
        # A pending call (the worker is stopped, so it cannot answer), and a thread blocked in
        # the step loop (with steps in flight, within two steps it waits on a result), when
        # the worker is killed.
        os.kill(pid, signal.SIGSTOP)
        pending = ex.sample_tokens(GrammarOutput(), non_block=True)
        errors: list[BaseException] = []

        def blocked_steps():
            try:
                for _ in range(10):
                    core.step()
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=blocked_steps)
        thread.start()
        time.sleep(0.2)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=f"pid {pid}"):
            pending.result(timeout=10)
        thread.join(10)
        assert time.monotonic() - killed < 5
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)
        assert is_failed(ex)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            ex.sample_tokens(GrammarOutput(), non_block=True)
        with pytest.raises(EngineDeadError):
            ex.collective_rpc("determine_num_kv_blocks")
        assert time.monotonic() - start < 1
        # The shared memory is unlinked even before shutdown.
        deadline = time.monotonic() + 5
        while [n for n in new_engine_entries(before) if n.startswith("mrv2_")]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)
        core.shutdown()
    assert_nothing_left(ex, before)


def test_worker_exits_when_the_parent_pipe_closes(engines):
    """The parent's death closes the only write end of the death pipe: simulate exactly that."""
    before = shm_entries()
    core = engines.take()
    ex = core.executor
    (pid,) = worker_pids(ex)
    ex._death_w.close()
    deadline = time.monotonic() + 10
    while process_alive(pid):
        assert time.monotonic() < deadline, "the worker outlived its parent's pipe"
        time.sleep(0.05)
    with pytest.raises(EngineDeadError):
        ex.collective_rpc("determine_num_kv_blocks", timeout=10)
    core.shutdown()
    assert_nothing_left(ex, before)


def test_startup_error_in_load_model_raises_the_workers_error(tiny_llama, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    config = EngineArgs(model=str(broken), max_model_len=128).create_engine_config()
    before, children = shm_entries(), set(mp.active_children())
    with pytest.raises(Exception) as info:
        EngineCore(config, executor_class=MultiprocExecutor)
    error = info.value
    assert "Traceback" in error.remote_traceback and "load_model" in error.remote_traceback
    assert not isinstance(error, EngineDeadError)
    assert set(mp.active_children()) <= children
    assert not lasting_engine_entries(before)


def test_startup_error_before_ready_carries_the_traceback(config):
    bad = dataclasses.replace(config, device="nonsense")
    before, children = shm_entries(), set(mp.active_children())
    with pytest.raises(WorkerStartupError, match="worker rank 0 .* failed to start") as info:
        MultiprocExecutor(bad)
    assert isinstance(info.value, WorkerError)
    assert "nonsense" in info.value.remote_traceback and "Traceback" in str(info.value)
    assert set(mp.active_children()) <= children
    assert not lasting_engine_entries(before)


def test_startup_timeout_names_the_silent_rank_and_stops_it(config, tmp_path, monkeypatch):
    """A worker that never reports ready (stuck in its constructor) fails the start after
    `startup_timeout_s`, not never; it is stopped and nothing is left."""
    (tmp_path / "stuck_worker.py").write_text(
        "import time\n\n\nclass StuckWorker:\n    def __init__(self, config):\n"
        "        time.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned children get the parent's sys.path
    before, children = shm_entries(), set(mp.active_children())
    start = time.monotonic()
    with pytest.raises(WorkerStartupError, match=r"rank\(s\) \[0\] did not report ready within"):
        MultiprocExecutor(config, worker_cls="stuck_worker:StuckWorker", startup_timeout_s=3.0)
    assert time.monotonic() - start < 3.0 + _STOP_BUDGET_S
    assert set(mp.active_children()) <= children
    assert not lasting_engine_entries(before)
