"""executor/shm_queue.py: ordering, wrap-around under slow readers, ZMQ overflow, readers in
other processes, timeouts that name the chunk and readers, closing, and unlinked segments."""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from executor.shm_queue import (ShmQueueClosed, ShmQueueHandle, ShmQueueReader, ShmQueueTimeout,
                                ShmQueueWriter)
from executor.shm_segment import unlink_segment

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 1024


def payload(seq: int, chunk: int) -> list[bytes]:
    """Message `seq`: two frames; every 5th is too big for a chunk (it goes through ZMQ)."""
    size = 3 * chunk + seq % 17 if seq % 5 == 2 else seq % 200
    return [bytes([seq % 251]) * size, seq.to_bytes(8, "little")]


READER = inspect.getsource(payload) + """
import sys, time, msgspec
from executor.shm_queue import ShmQueueHandle, ShmQueueReader
handle = msgspec.json.decode(sys.argv[1], type=ShmQueueHandle)
rank, count, slow = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
reader = ShmQueueReader(handle, rank)
for seq in range(count):
    frames = [bytes(f) for f in reader.dequeue(timeout=60)]
    if frames != payload(seq, handle.chunk_bytes):
        print(f"reader {rank}: message {seq} is wrong: {[len(f) for f in frames]}", flush=True)
        sys.exit(1)
    if slow and seq % 10 == 0:
        time.sleep(slow)
reader.close()
print(f"reader {rank}: ok {count}", flush=True)
"""


def segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@pytest.fixture
def writer():
    queues: list[ShmQueueWriter] = []

    def make(num_readers: int, num_chunks: int = 4, chunk_bytes: int = CHUNK) -> ShmQueueWriter:
        queues.append(ShmQueueWriter(num_readers, num_chunks, chunk_bytes))
        return queues[-1]

    yield make
    for q in queues:
        q.close()
        assert not segment_exists(q.name)


def test_order_and_wrap_around_in_process(writer):
    w = writer(2, num_chunks=3)
    readers = [ShmQueueReader(w.handle, r) for r in range(2)]
    for seq in range(200):  # ~67 laps of a 3-chunk ring; readers never fall behind by 3
        w.enqueue(payload(seq, CHUNK), timeout=10)
        for r in readers:
            assert [bytes(f) for f in r.dequeue(timeout=10)] == payload(seq, CHUNK)
    for r in readers:
        r.close()


@pytest.mark.parametrize("num_readers", [1, 3])
def test_readers_in_other_processes(writer, num_readers):
    """Many laps of a 4-chunk ring with one slow reader, oversized messages interleaved."""
    w = writer(num_readers, num_chunks=4)
    count = 300
    handle = msgspec.json.encode(w.handle).decode()
    procs = [subprocess.Popen([sys.executable, "-c", READER, handle, str(rank), str(count),
                               "0.02" if rank == num_readers - 1 else "0"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(num_readers)]
    try:
        for seq in range(count):
            w.enqueue(payload(seq, CHUNK), timeout=60)
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"reader {rank}: ok {count}" in out, out
    # Readers that exited did not take the segment with them (no resource-tracker unlink).
    assert segment_exists(w.name)


def test_oversized_message_goes_through_zmq_intact(writer):
    w = writer(2, num_chunks=2)
    readers = [ShmQueueReader(w.handle, r) for r in range(2)]
    big = os.urandom(3 * CHUNK)
    w.enqueue([b"head", big, b"tail"], timeout=10)
    w.enqueue(b"small", timeout=10)
    for r in readers:
        assert [bytes(f) for f in r.dequeue(timeout=10)] == [b"head", big, b"tail"]
        assert [bytes(f) for f in r.dequeue(timeout=10)] == [b"small"]
        r.close()


def test_frames_are_aligned_private_and_writable(writer):
    w = writer(1)
    r = ShmQueueReader(w.handle, 0)
    w.enqueue([b"abc", bytes(100), bytes(7)], timeout=5)
    frames = r.dequeue(timeout=5)
    assert [len(f) for f in frames] == [3, 100, 7]
    import numpy as np
    assert all(np.frombuffer(f, np.uint8).ctypes.data % 16 == 0 for f in frames)
    frames[1][0] = 9  # a private copy: writing it cannot touch the ring
    w.enqueue(b"next", timeout=5)
    assert bytes(r.dequeue(timeout=5)[0]) == b"next"
    r.close()


def test_one_frame_and_no_frame_messages(writer):
    """The one-frame fast path (bytes, bytearray, a typed memoryview, sent bare or in a list,
    in a chunk or over ZMQ) and a message of no frames, over several laps of the ring."""
    import numpy as np
    w = writer(1, num_chunks=2)
    r = ShmQueueReader(w.handle, 0)
    ints = np.arange(5, dtype=np.int32)
    cases = [(b"x" * 40, [b"x" * 40]), ([bytearray(b"ab")], [b"ab"]), (b"", [b""]),
             (memoryview(ints), [ints.tobytes()]), ([], []),
             ([bytes(3 * CHUNK)], [bytes(3 * CHUNK)])]
    for _ in range(3):
        for message, expected in cases:
            w.enqueue(message, timeout=5)
            got = r.dequeue(timeout=5)
            assert [bytes(f) for f in got] == expected
            if sum(map(len, expected)) < CHUNK:  # in a chunk: aligned (ZMQ's are its own)
                assert all(np.frombuffer(f, np.uint8).ctypes.data % 16 == 0 for f in got)
    r.close()


def test_tensors_through_the_queue_decode_in_place(writer):
    import numpy as np
    import torch

    from executor.serial import MsgpackDecoder, MsgpackEncoder

    w = writer(1, chunk_bytes=1 << 16)
    r = ShmQueueReader(w.handle, 0)
    obj = {"logits": torch.randn(8, 512), "ids": np.arange(300, dtype=np.int32),
           "half": torch.ones(1000, dtype=torch.bfloat16)}
    for _ in range(2):  # in a chunk, then (too big for it) through the overflow socket
        w.enqueue(MsgpackEncoder().encode(obj), timeout=10)
        frames = r.dequeue(timeout=10)
        back = MsgpackDecoder().decode(frames)
        assert torch.equal(back["logits"], obj["logits"])
        assert torch.equal(back["half"], obj["half"])
        np.testing.assert_array_equal(back["ids"], obj["ids"])
        starts = {np.frombuffer(f, np.uint8).ctypes.data for f in frames}
        assert back["logits"].data_ptr() in starts  # no copy after the queue's own
        obj["logits"] = torch.randn(64, 512)
    r.close()


def test_writer_timeout_names_chunk_and_unread_readers(writer):
    w = writer(3, num_chunks=2)
    readers = [ShmQueueReader(w.handle, r) for r in range(3)]
    w.enqueue(b"m0")
    w.enqueue(b"m1")
    readers[0].dequeue(timeout=1)
    readers[1].dequeue(timeout=1)
    start = time.monotonic()
    with pytest.raises(ShmQueueTimeout, match=r"chunk 0 \(message 0\) is still unread by "
                                              r"reader\(s\) \[2\] of 3"):
        w.enqueue(b"m2", timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 2
    readers[2].dequeue(timeout=1)
    w.enqueue(b"m2", timeout=1)  # the failed enqueue changed nothing
    assert bytes(readers[0].dequeue(timeout=1)[0]) == b"m1"
    assert bytes(readers[0].dequeue(timeout=1)[0]) == b"m2"
    for r in readers:
        r.close()


def test_reader_timeout_names_chunk(writer):
    w = writer(1)
    r = ShmQueueReader(w.handle, 0)
    w.enqueue(b"x")
    r.dequeue(timeout=1)
    with pytest.raises(ShmQueueTimeout, match=r"reader 0 waited .* for chunk 1 \(message 1\)"):
        r.dequeue(timeout=0.05)
    r.close()


def test_blocked_reader_is_woken_by_the_writer(writer):
    w = writer(1)
    # A long bounded block: only the writer's wake-up can make the reader return quickly.
    r = ShmQueueReader(w.handle, 0, max_block_s=2.0)
    got: list[tuple[bytes, float]] = []

    def read():
        frames = r.dequeue(timeout=10)
        got.append((bytes(frames[0]), time.monotonic()))

    for message in (b"late", b"later"):
        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.1)  # the reader is blocked by now
        sent = time.monotonic()
        w.enqueue(message)
        t.join(5)
        assert got[-1][0] == message and got[-1][1] - sent < 1.0
    r.close()


def test_abort_ends_a_wait(writer):
    w = writer(1)
    r = ShmQueueReader(w.handle, 0)
    stop = time.monotonic() + 0.1

    def abort():
        if time.monotonic() > stop:
            raise InterruptedError("stop")

    with pytest.raises(InterruptedError):
        r.dequeue(abort=abort)
    r.close()


def test_close_unlinks_and_readers_drain_then_see_closed():
    w = ShmQueueWriter(1, 4, CHUNK)
    r = ShmQueueReader(w.handle, 0)
    name = w.name
    assert segment_exists(name)
    w.enqueue(b"last")
    w.close()
    w.close()  # idempotent
    assert not segment_exists(name)
    assert bytes(r.dequeue(timeout=1)[0]) == b"last"
    with pytest.raises(ShmQueueClosed):
        r.dequeue(timeout=5)
    r.close()
    with pytest.raises(ShmQueueClosed):
        w.enqueue(b"more")


def test_names_are_unique_and_handles_travel():
    a, b = ShmQueueWriter(1, 2, CHUNK), ShmQueueWriter(1, 2, CHUNK)
    try:
        assert a.name != b.name and str(os.getpid()) in a.name
        assert a.handle.zmq_address != b.handle.zmq_address
        for handle in (a.handle, b.handle):
            assert pickle.loads(pickle.dumps(handle)) == handle
            assert msgspec.msgpack.decode(msgspec.msgpack.encode(handle),
                                          type=ShmQueueHandle) == handle
    finally:
        a.close()
        b.close()


def test_unlink_segment_by_name():
    w = ShmQueueWriter(1, 2, CHUNK)
    assert unlink_segment(w.name) is True
    assert not segment_exists(w.name)
    assert unlink_segment(w.name) is False
    w.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        ShmQueueWriter(0)
    w = ShmQueueWriter(2, 2, CHUNK)
    with pytest.raises(ValueError, match="rank 2"):
        ShmQueueReader(w.handle, 2)
    w.close()
