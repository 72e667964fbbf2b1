"""RankBroadcast: one call reaches the ranks on this node (shared memory, each its reader) and
the ranks on others (a ZMQ channel each) alike, in order; unlinking tells both kinds."""

from __future__ import annotations

import pytest

from executor.rank_broadcast import RankBroadcast
from executor.shm_queue import ShmQueueReader
from executor.shm_ring import ShmQueueClosed
from executor.zmq_channel import ZmqReceiver, ZmqSender


@pytest.mark.parametrize("num_local, num_remote", [(2, 1), (0, 2), (1, 0)])
def test_every_rank_gets_every_message_in_order(num_local, num_remote):
    senders = [ZmqSender(bind_host="127.0.0.1") for _ in range(num_remote)]
    broadcast = RankBroadcast(num_local, senders, 4, 1 << 12)
    assert (broadcast.handle is None) == (num_local == 0)
    readers = [ShmQueueReader(broadcast.handle, i) for i in range(num_local)]
    readers += [ZmqReceiver(address=s.address) for s in senders]
    try:
        messages = [[b"call", bytes([i])] for i in range(10)]  # more than the ring's 4 chunks
        for message in messages[:3]:
            broadcast.enqueue(message, timeout=5)
        for reader in readers:
            assert [[bytes(f) for f in reader.dequeue(timeout=5)] for _ in range(3)] == \
                messages[:3]
        broadcast.unlink()
        for reader in readers:
            with pytest.raises(ShmQueueClosed):
                reader.dequeue(timeout=5)
    finally:
        for reader in readers:
            reader.close()
        broadcast.close()
