"""The executor's broadcast of each call to every worker rank, wherever the ranks run: the
shared-memory queue for the ranks on the engine core's node (one write, read by each), and a
ZMQ channel for each rank on another node (executor/zmq_channel.py: the same frames sent once
per such rank). Messages reach every rank in the order they were sent."""

from __future__ import annotations

from executor.shm_queue import ShmQueueHandle, ShmQueueWriter
from executor.shm_ring import Abort, Frames
from executor.zmq_channel import ZmqSender


class RankBroadcast:
    def __init__(self, num_local: int, remote: list[ZmqSender], num_chunks: int,
                 chunk_bytes: int) -> None:
        self.local = ShmQueueWriter(num_local, num_chunks, chunk_bytes) if num_local else None
        self.remote = remote

    @property
    def handle(self) -> ShmQueueHandle | None:
        """Where the local ranks attach (each as its reader index); None without any."""
        return None if self.local is None else self.local.handle

    def enqueue(self, frames: Frames | bytes, timeout: float | None = None,
                abort: Abort | None = None) -> None:
        """To every rank; `timeout` bounds each transport's wait."""
        if self.local is not None:
            self.local.enqueue(frames, timeout=timeout, abort=abort)
        for sender in self.remote:
            sender.enqueue(frames, timeout=timeout, abort=abort)

    def unlink(self) -> None:
        """Tell every rank the engine is gone: idle ranks leave their loops."""
        if self.local is not None:
            self.local.unlink()
        for sender in self.remote:
            sender.close()

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        for sender in self.remote:
            sender.close()
