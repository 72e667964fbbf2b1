"""executor/deferred.py: replies in call order with deferred values resolved off the caller's
thread, the decoder's view of `T | Deferred[T]`, and both executors overlapping step N+1's
phase 1 with step N's output (issue: overlap on the worker)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from executor.deferred import Deferred, OrderedReplies, resolved_type
from executor.multiproc import MultiprocExecutor
from executor.uniproc import UniProcExecutor

from deferring_worker import RESOLVE_S


class Gate(Deferred[int]):
    def __init__(self, value: int, gate: threading.Event) -> None:
        self.value, self.gate = value, gate

    def resolve(self) -> int:
        assert self.gate.wait(5.0)
        return self.value


def test_resolved_type_reads_through_deferred() -> None:
    assert resolved_type(int | Deferred[int]) is int
    assert resolved_type(Deferred[str]) is str
    assert resolved_type(int | None) == (int | None)
    assert resolved_type(list[int]) == list[int]


def test_replies_keep_call_order_behind_a_deferred_value() -> None:
    replies, sent = OrderedReplies("test-replies"), []
    gate = threading.Event()

    def send(tag: str):
        return lambda value, error: sent.append((tag, value, error))

    replies.submit(1, send("ready"))  # nothing queued: sent on the caller's thread
    assert sent == [("ready", 1, None)]
    replies.submit(Gate(2, gate), send("deferred"))
    replies.submit(3, send("after"))  # ready, but must wait behind the deferred one
    time.sleep(0.05)
    assert [s[0] for s in sent] == ["ready"]
    gate.set()
    assert replies.drain(timeout=5.0)
    assert sent == [("ready", 1, None), ("deferred", 2, None), ("after", 3, None)]
    replies.submit(4, send("direct"))  # drained: direct again
    assert sent[-1] == ("direct", 4, None)


def test_a_failed_resolve_is_that_reply_only() -> None:
    class Broken(Deferred[int]):
        def resolve(self) -> int:
            raise ValueError("copy failed")

    replies, sent = OrderedReplies("test-replies"), []
    replies.submit(Broken(), lambda v, e: sent.append((v, e)))
    replies.submit(5, lambda v, e: sent.append((v, e)))
    assert replies.drain(timeout=5.0)
    assert isinstance(sent[0][1], ValueError) and sent[0][0] is None
    assert sent[1] == (5, None)


def _overlap(executor) -> tuple[list[float], float]:
    executor.execute_model(0)
    output = executor.sample_tokens(False, non_block=True)
    phase1 = executor.execute_model(1, non_block=True)  # step N+1 while N's output is pending
    if isinstance(phase1, Future):
        phase1.result(timeout=5.0)
    resolved_at = output.result(timeout=5.0)
    return executor.collective_rpc("execute_starts")[0], resolved_at


def test_uniproc_runs_the_next_phase_1_before_the_output_is_resolved() -> None:
    executor = UniProcExecutor(None, worker_cls="deferring_worker:DeferringWorker")
    try:
        starts, resolved_at = _overlap(executor)
        assert starts[1] < resolved_at - RESOLVE_S / 2
        # Blocking phase 2 resolves before returning; a failed resolve reaches the caller.
        assert executor.sample_tokens(False) >= starts[1]
        with pytest.raises(ValueError, match="copy failed"):
            executor.sample_tokens(True, non_block=True).result(timeout=5.0)
    finally:
        executor.shutdown()


def test_multiproc_worker_runs_the_next_phase_1_before_the_output_is_resolved(tiny_llama):
    from mrv2.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(tiny_llama)).create_engine_config()
    executor = MultiprocExecutor(config, worker_cls="deferring_worker:DeferringWorker")
    try:
        starts, resolved_at = _overlap(executor)
        assert starts[1] < resolved_at - RESOLVE_S / 2
        # Replies stayed in call order, and a failed resolve is that call's error only.
        with pytest.raises(ValueError, match="copy failed"):
            executor.sample_tokens(True)
        assert executor.collective_rpc("execute_starts")[0] == starts
    finally:
        executor.shutdown()
