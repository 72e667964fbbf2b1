"""The engine-core process at the wire level: run_engine_core driven over raw ZMQ sockets.

One core process serves the module (spawning one costs seconds of imports: torch and
transformers); the last test ends it with a fatal step. Parent death has its own process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import msgspec
import pytest
import zmq

from mrv2.core.core_proc import run_engine_core
from mrv2.core.engine_core import EngineCore
from mrv2.engine.arg_utils import EngineArgs
from mrv2.core_framing import ABORT, ADD, DEAD, OUTPUTS, REJECTED, UTILITY, UTILITY_RESULT
from mrv2.protocol import (CoreDead, CoreReady, EngineCoreOutputs, EngineCoreRequest,
                           RequestRejected, UtilityCall, UtilityResult)
from mrv2.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 300], [9, 8, 7, 6, 5, 4], [1000, 3]]
DECODERS = {OUTPUTS: EngineCoreOutputs, UTILITY_RESULT: UtilityResult,
            REJECTED: RequestRejected, DEAD: CoreDead}


def request(request_id: str, prompt: list[int], params: SamplingParams = GREEDY):
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt,
                             sampling_params=params, eos_token_id=1, arrival_time=0.0)


class RawCore:
    """A core process and the client ends of its sockets, without any client class."""

    def __init__(self, config, directory) -> None:
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDTIMEO, 5000)  # a dead core fails the test, not hangs it
        self.input.bind(f"ipc://{directory}/in")
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(f"ipc://{directory}/out")
        spawn = mp.get_context("spawn")
        ready_r, ready_w = spawn.Pipe(duplex=False)
        death_r, self.death_w = spawn.Pipe(duplex=False)
        self.proc = spawn.Process(target=run_engine_core, args=(
            config, f"ipc://{directory}/in", f"ipc://{directory}/out", ready_w, death_r))
        self.proc.start()
        ready_w.close()
        death_r.close()
        assert ready_r.poll(60), "the core did not report ready"
        self.ready = msgspec.msgpack.decode(ready_r.recv_bytes(), type=CoreReady)
        ready_r.close()
        if self.ready.error is not None:
            self.close()
            raise RuntimeError(f"the core failed to start:\n{self.ready.error}")
        self.calls = 0

    def send(self, kind: bytes, message=None) -> None:
        body = b"" if message is None else msgspec.msgpack.encode(message)
        self.input.send_multipart([kind, body])

    def recv(self, timeout_s: float = 10.0):
        assert self.output.poll(int(timeout_s * 1000)), "no message from the core"
        kind, body = self.output.recv_multipart()
        return kind, msgspec.msgpack.decode(body, type=DECODERS[kind])

    def utility(self, method: str, *args):
        self.calls += 1
        self.send(UTILITY, UtilityCall(self.calls, method, list(args)))
        while True:
            kind, message = self.recv()
            if kind == UTILITY_RESULT:
                assert message.call_id == self.calls
                return message

    def close(self) -> None:
        self.death_w.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def config(tiny_llama):
    return EngineArgs(model=str(tiny_llama), max_model_len=128, max_num_seqs=8,
                      device="cpu").create_engine_config()


@pytest.fixture(scope="module")
def core(config, tmp_path_factory):
    raw = RawCore(config, tmp_path_factory.mktemp("ipc"))
    yield raw
    raw.close()


def collect(core: RawCore, request_ids) -> dict[str, list[int]]:
    tokens = {rid: [] for rid in request_ids}
    unfinished = set(request_ids)
    while unfinished:
        kind, message = core.recv()
        assert kind == OUTPUTS
        for out in message.outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                unfinished.discard(out.request_id)
    return tokens


def wait_idle(core: RawCore, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = core.utility("get_stats").result
        if not stats["has_unfinished"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_outputs_equal_an_in_process_core(core, config):
    assert core.ready.error is None and core.ready.pid == core.proc.pid
    for i, prompt in enumerate(PROMPTS):
        core.send(ADD, request(f"r{i}", prompt))
    got = collect(core, [f"r{i}" for i in range(len(PROMPTS))])

    local = EngineCore(config)
    for i, prompt in enumerate(PROMPTS):
        local.add_request(request(f"r{i}", prompt))
    want = {f"r{i}": [] for i in range(len(PROMPTS))}
    while local.has_unfinished_requests():
        for out in local.step().outputs:
            want[out.request_id] += out.new_token_ids
    local.shutdown()
    assert got == want and all(len(t) == GREEDY.max_tokens for t in got.values())


def test_abort_frees_the_request(core):
    core.send(ADD, request("long", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True)))
    kind, first = core.recv()
    assert kind == OUTPUTS and first.outputs[0].request_id == "long"
    core.send(ABORT, ["long", "unknown-id"])
    stats = wait_idle(core)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_cache_usage"] == 0 and not stats["has_unfinished"]
    # Outputs already sent before the abort are all that come: drain them, nothing finishes.
    while core.output.poll(100):
        kind, message = core.recv()
        assert all(not o.finished for o in message.outputs)


def test_a_refused_request_is_rejected_not_fatal(core):
    core.send(ADD, request("dup", [5, 6], SamplingParams(max_tokens=60, ignore_eos=True)))
    core.send(ADD, request("dup", [7, 8]))
    rejected = None
    tokens = []
    while True:
        kind, message = core.recv()
        if kind == REJECTED:
            rejected = message
        else:
            tokens += [t for o in message.outputs for t in o.new_token_ids]
            if any(o.finished for o in message.outputs):
                break
    assert rejected.request_id == "dup" and rejected.exc_type == "ValueError"
    assert "already queued" in rejected.message
    assert len(tokens) == 60  # the first "dup" ran to the end
    assert not wait_idle(core)["has_unfinished"]


def test_utilities(core):
    assert core.utility("echo", 1, "two", [3]).result == [1, "two", [3]]
    reply = core.utility("no_such_method")
    assert reply.exc_type == "AttributeError" and "no_such_method" in reply.error
    assert "Traceback" in reply.traceback
    stats = core.utility("get_stats").result
    assert stats["num_kv_blocks"] == core.ready.num_kv_blocks > 1
    assert core.utility("reset_prefix_cache").result is True


def test_idle_core_uses_no_cpu(core):
    wait_idle(core)
    time.sleep(0.1)
    before = cpu_seconds(core.proc.pid)
    time.sleep(1.0)
    assert cpu_seconds(core.proc.pid) - before < 0.05


def test_exits_when_the_parent_dies(config, tmp_path):
    raw = RawCore(config, tmp_path)
    try:
        raw.send(ADD, request("r", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True)))
        raw.recv()
        start = time.monotonic()
        raw.death_w.close()  # what the kernel does when the parent dies
        raw.proc.join(10)
        assert raw.proc.exitcode == 0 and time.monotonic() - start < 5
    finally:
        raw.close()


def test_a_failing_step_reports_dead_and_exits(core, config):
    # Last test on the module's core: it ends the process. (A clean SHUTDOWN is covered by
    # the client tests.)
    core.send(ADD, request("ok", [5, 6], SamplingParams(max_tokens=100, ignore_eos=True)))
    # Past the vocabulary: the front end would refuse it; the runner fails on it.
    core.send(ADD, request("bad", [5, config.model_config.vocab_size + 10]))
    while True:
        kind, message = core.recv()
        if kind == DEAD:
            break
    assert "Traceback" in message.reason and "engine core failed" in message.reason
    core.proc.join(10)
    assert core.proc.exitcode == 1
