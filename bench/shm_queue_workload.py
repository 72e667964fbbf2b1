"""One step's RPC round trip, three ways, for bench/test_shm_queue.py.

The parent encodes `RPCCall("execute_model", (SchedulerOutput of N decodes,))`, a worker
process receives and decodes it (typed, as the real worker does), and replies with a
`ModelRunnerOutput` for the N requests, which the parent receives and decodes.

- shm: executor.serial frames over a ShmQueueWriter / per-worker reply queue
- zmq: the same frames over a ZMQ PAIR socket (ipc://)
- mp_queue: pickle over two multiprocessing.Queue objects (what the executor replaced)

`raw_round_trip` sends pre-encoded bytes of the same sizes and gets fixed bytes back: the
transport alone, without (de)serialisation.

Each server is a spawned process, started once per module.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import uuid

import numpy as np

from executor.packed import int32_bytes, ones_int32_bytes
from executor.serial import MethodTypes, MsgpackEncoder, RPCCall, RPCReply
from executor.shm_queue import DEFAULT_SPIN_S, ShmQueueReader, ShmQueueWriter
from mrv2.protocol import CachedRequestData, GrammarOutput, ModelRunnerOutput, SchedulerOutput


def decode_step(num_reqs: int, step: int = 0) -> SchedulerOutput:
    """A SchedulerOutput of `num_reqs` running requests, one token each; every 16th request
    crosses a block boundary and gets a new block, like a real decode step."""
    req_ids = [f"cmpl-{i:08x}-0" for i in range(num_reqs)]
    computed = [100 + i % 300 + step for i in range(num_reqs)]
    # One KV cache group: per request, a list of the group's new block ids.
    new_blocks = [[[1000 + i] if c % 16 == 0 else []] for i, c in enumerate(computed)]
    return SchedulerOutput.build(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.build(req_ids=req_ids, new_block_ids=new_blocks,
                                                num_computed_tokens=computed),
        num_scheduled_tokens=dict.fromkeys(req_ids, 1), total_num_scheduled_tokens=num_reqs)


def runner_output(sched: SchedulerOutput) -> ModelRunnerOutput:
    """What the runner replies for a decode step: one sampled token per request (a stand-in
    for the sampler's tensor), the request ids passed through in batch order."""
    n = sched.num_reqs
    return ModelRunnerOutput(sched.req_ids_packed, n, int32_bytes(np.arange(n, dtype=np.int32)),
                             ones_int32_bytes(n))


def msgpack_sizes(sched: SchedulerOutput) -> dict[str, int]:
    encoder = MsgpackEncoder()
    call = encoder.encode(RPCCall(1, "execute_model", (sched,)))
    reply = encoder.encode(RPCReply(1, 0, runner_output(sched)))
    return {"request_bytes": sum(len(f) for f in call), "reply_bytes": sum(len(f) for f in reply)}


class EchoWorker:
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return runner_output(scheduler_output)


class TwoPhaseEchoWorker:
    """A worker without a model for an executor (bench/test_executor_round_trip.py): phase 1
    keeps the step, phase 2 answers it as the runner would."""

    def __init__(self, config: object) -> None:
        self._step: SchedulerOutput | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._step = scheduler_output

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return runner_output(self._step)


RAW = b"RAW"


def _raw_reply(request: memoryview | bytes) -> bytes | None:
    """For a raw request (RAW + 4-byte reply size + padding): the reply bytes."""
    # First byte first: an RPC message starts with a msgpack array header, never with "R"
    # (the mp_queue server tells the two apart by type, as cheaply).
    if request[0] != RAW[0] or bytes(request[:3]) != RAW:
        return None
    return bytes(int.from_bytes(request[3:7], "little"))


def raw_request(request_bytes: int, reply_bytes: int) -> bytes:
    return RAW + reply_bytes.to_bytes(4, "little") + bytes(request_bytes - 7)


def _shm_server(handle, conn, spin_s: float) -> None:
    requests = ShmQueueReader(handle, 0, spin_s=spin_s)
    replies = ShmQueueWriter(1, spin_s=spin_s)
    conn.send(replies.handle)
    types, encoder, worker = MethodTypes(EchoWorker), MsgpackEncoder(), EchoWorker()
    while True:
        frames = requests.dequeue()
        if (raw := _raw_reply(frames[0])) is not None:
            replies.enqueue(raw)
            continue
        call = types.decode_call(frames)
        if call.method == "stop":
            break
        args = types.decode_args(call, frames)
        replies.enqueue(encoder.encode(RPCReply(call.call_id, 0,
                                                getattr(worker, call.method)(*args))))
    requests.close()
    replies.close()


def _zmq_server(address: str) -> None:
    import zmq
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    types, encoder, worker = MethodTypes(EchoWorker), MsgpackEncoder(), EchoWorker()
    while True:
        frames = [f.buffer for f in sock.recv_multipart(copy=False)]
        if (raw := _raw_reply(frames[0])) is not None:
            sock.send(raw)
            continue
        call = types.decode_call(frames)
        if call.method == "stop":
            break
        args = types.decode_args(call, frames)
        sock.send_multipart(encoder.encode(RPCReply(call.call_id, 0,
                                                    getattr(worker, call.method)(*args))))
    sock.close(linger=0)


def _mp_queue_server(requests, replies) -> None:
    worker = EchoWorker()
    while True:
        message = requests.get()
        if isinstance(message, bytes):
            replies.put(_raw_reply(message))
            continue
        method, args = message
        if method == "stop":
            break
        replies.put(getattr(worker, method)(*args))


class ShmTransport:
    name = "shm"

    def __init__(self, spin_s: float = DEFAULT_SPIN_S) -> None:
        ctx = mp.get_context("spawn")
        self.requests = ShmQueueWriter(1, spin_s=spin_s)
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_shm_server, args=(self.requests.handle, child, spin_s),
                                daemon=True)
        self.proc.start()
        self.replies = ShmQueueReader(parent.recv(), 0, spin_s=spin_s)
        self.encoder, self.types, self.ids = MsgpackEncoder(), MethodTypes(EchoWorker), 0

    def round_trip(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.ids += 1
        self.requests.enqueue(self.encoder.encode(RPCCall(self.ids, "execute_model", (sched,))))
        reply, value = self.types.decode_reply(self.replies.dequeue(timeout=30), "execute_model")
        return value

    def raw_round_trip(self, request: bytes) -> int:
        self.requests.enqueue(request)
        return len(self.replies.dequeue(timeout=30)[0])

    def sizes(self, sched: SchedulerOutput) -> dict[str, int]:
        return msgpack_sizes(sched)

    def close(self) -> None:
        self.requests.enqueue(self.encoder.encode(RPCCall(0, "stop")))
        self.proc.join(10)
        self.replies.close()
        self.requests.close()


class ZmqTransport(ShmTransport):
    name = "zmq"

    def __init__(self) -> None:
        import zmq
        ctx = mp.get_context("spawn")
        self.path = os.path.join(tempfile.gettempdir(), f"mrv2-bench-{uuid.uuid4().hex}")
        address = f"ipc://{self.path}"
        self.sock = zmq.Context.instance().socket(zmq.PAIR)
        self.sock.bind(address)
        self.proc = ctx.Process(target=_zmq_server, args=(address,), daemon=True)
        self.proc.start()
        self.encoder, self.types, self.ids = MsgpackEncoder(), MethodTypes(EchoWorker), 0

    def round_trip(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.ids += 1
        self.sock.send_multipart(self.encoder.encode(RPCCall(self.ids, "execute_model",
                                                             (sched,))))
        frames = [f.buffer for f in self.sock.recv_multipart(copy=False)]
        return self.types.decode_reply(frames, "execute_model")[1]

    def raw_round_trip(self, request: bytes) -> int:
        self.sock.send(request)
        return len(self.sock.recv(copy=False).buffer)

    def close(self) -> None:
        self.sock.send_multipart(self.encoder.encode(RPCCall(0, "stop")))
        self.proc.join(10)
        self.sock.close(linger=0)
        if os.path.exists(self.path):
            os.unlink(self.path)


class MpQueueTransport:
    name = "mp_queue"

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_mp_queue_server, args=(self.requests, self.replies),
                                daemon=True)
        self.proc.start()

    def round_trip(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.requests.put(("execute_model", (sched,)))
        return self.replies.get(timeout=30)

    def raw_round_trip(self, request: bytes) -> int:
        self.requests.put(request)
        return len(self.replies.get(timeout=30))

    def sizes(self, sched: SchedulerOutput) -> dict[str, int]:
        import pickle
        return {"request_bytes": len(pickle.dumps(("execute_model", (sched,)))),
                "reply_bytes": len(pickle.dumps(runner_output(sched)))}

    def close(self) -> None:
        self.requests.put(("stop", ()))
        self.proc.join(10)
        for q in (self.requests, self.replies):
            q.close()
            q.join_thread()


TRANSPORTS = {t.name: t for t in (ShmTransport, ZmqTransport, MpQueueTransport)}
