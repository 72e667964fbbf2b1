"""ZmqSender / ZmqReceiver: messages whole and in order, the shared-memory queue's timeout,
abort and closed contract, and either end binding."""

from __future__ import annotations

import threading
import time

import pytest

from executor.shm_ring import ShmQueueClosed, ShmQueueTimeout
from executor.zmq_channel import CLOSED, ZmqReceiver, ZmqSender


@pytest.fixture
def channel():
    receiver = ZmqReceiver(bind_host="127.0.0.1")
    sender = ZmqSender(address=receiver.address)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_messages_arrive_whole_and_in_order(channel):
    sender, receiver = channel
    assert receiver.address.startswith("tcp://127.0.0.1:")
    messages = [[b"a"], [b"\x93\x01\x02", bytearray(b"xyz"), memoryview(b"")], b"one frame"]
    for message in messages:
        sender.enqueue(message)
    got = [[bytes(f) for f in receiver.dequeue(timeout=5)] for _ in messages]
    assert got == [[b"a"], [b"\x93\x01\x02", b"xyz", b""], [b"one frame"]]


def test_a_wait_times_out_and_abort_is_called_between_blocks(channel):
    _, receiver = channel
    start = time.monotonic()
    with pytest.raises(ShmQueueTimeout, match="waited 0.10 s to receive"):
        receiver.dequeue(timeout=0.1)
    assert time.monotonic() - start < 1
    calls = []

    def abort() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError, match="engine gone"):
        receiver.dequeue(abort=abort)


def test_closing_the_sender_closes_the_receiver_after_its_messages(channel):
    sender, receiver = channel
    sender.enqueue([b"last"])
    sender.close()
    sender.close()  # idempotent
    assert [bytes(f) for f in receiver.dequeue(timeout=5)] == [b"last"]
    with pytest.raises(ShmQueueClosed, match="closed by its sender"):
        receiver.dequeue(timeout=5)
    with pytest.raises(ShmQueueClosed):  # and stays closed
        receiver.dequeue(timeout=0)
    assert not CLOSED.startswith(bytes([0x90]))  # never a msgpack array's first byte


def test_the_sender_can_bind_and_wait_for_its_peer():
    sender = ZmqSender(bind_host="127.0.0.1")
    got = []

    def late_receiver() -> None:
        time.sleep(0.2)
        receiver = ZmqReceiver(address=sender.address)
        got.append(bytes(receiver.dequeue(timeout=5)[0]))
        receiver.close()

    thread = threading.Thread(target=late_receiver)
    thread.start()
    sender.enqueue(b"sent before anyone listened")  # kept until the peer connects
    thread.join(10)
    sender.close()
    assert got == [b"sent before anyone listened"]


def test_an_end_binds_or_connects():
    with pytest.raises(ValueError, match="either binds"):
        ZmqSender()
    with pytest.raises(ValueError, match="either binds"):
        ZmqReceiver(bind_host="127.0.0.1", address="tcp://127.0.0.1:1")
