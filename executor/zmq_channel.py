"""A one-way message channel over ZMQ TCP, for a worker rank on another node than the engine
core (the shared-memory queue, executor/shm_queue.py, reaches only its own node).

`ZmqSender` (PUSH) and `ZmqReceiver` (PULL) carry a message, a list of frames, whole and in
order, with the shared-memory queue's `enqueue` / `dequeue` contract: waits in bounded steps
(`max_block_s`) that call `abort`, `ShmQueueTimeout` past a timeout, `ShmQueueClosed` once the
sender has closed. One end binds (on the engine core's node address, an ephemeral port: its
`address` is handed to the other end), the other connects.

A PUSH socket never drops: with no peer yet, or a full pipe, a send waits. Closing the sender
sends the one-frame message `CLOSED` first (best effort): an RPC message is a msgpack array,
whose first byte is never 0x00, so no message is mistaken for it.
"""

from __future__ import annotations

import time

import zmq

from executor.shm_ring import (DEFAULT_MAX_BLOCK_S, Abort, Frames, ShmQueueClosed,
                               ShmQueueTimeout)

CLOSED = b"\x00mrv2-channel-closed"
_CLOSE_LINGER_MS = 1000  # how long a closing sender may still deliver CLOSED


class _Channel:
    def __init__(self, kind: int, *, bind_host: str | None = None, address: str | None = None,
                 max_block_s: float = DEFAULT_MAX_BLOCK_S) -> None:
        if (bind_host is None) == (address is None):
            raise ValueError("a channel end either binds (bind_host) or connects (address)")
        self._socket: zmq.Socket | None = zmq.Context.instance().socket(kind)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.max_block_s = max_block_s
        if bind_host is not None:
            port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
            address = f"tcp://{bind_host}:{port}"
        else:
            self._socket.connect(address)
        self.address: str = address

    def _wait(self, event: int, what: str, timeout: float | None, abort: Abort | None) -> None:
        if self._socket is None:
            raise ShmQueueClosed(f"zmq channel {self.address} is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._socket.poll(0, event):
            if abort is not None:
                abort()
            left = self.max_block_s if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise ShmQueueTimeout(f"zmq channel {self.address}: waited {timeout:.2f} s to "
                                      f"{what}")
            self._socket.poll(int(min(left, self.max_block_s) * 1000) or 1, event)


class ZmqSender(_Channel):
    def __init__(self, *, bind_host: str | None = None, address: str | None = None,
                 max_block_s: float = DEFAULT_MAX_BLOCK_S) -> None:
        super().__init__(zmq.PUSH, bind_host=bind_host, address=address,
                         max_block_s=max_block_s)

    def enqueue(self, frames: Frames | bytes, timeout: float | None = None,
                abort: Abort | None = None) -> None:
        parts = [frames] if isinstance(frames, (bytes, bytearray, memoryview)) else list(frames)
        self._wait(zmq.POLLOUT, "send", timeout, abort)
        self._socket.send_multipart(parts, copy=False)

    def close(self) -> None:
        """Send CLOSED if the pipe takes it, then close (idempotent)."""
        if self._socket is None:
            return
        try:
            self._socket.send(CLOSED, zmq.NOBLOCK)
            self._socket.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
        except zmq.ZMQError:  # no peer or a full pipe: the peer learns it otherwise
            pass
        self._socket.close()
        self._socket = None


class ZmqReceiver(_Channel):
    def __init__(self, *, bind_host: str | None = None, address: str | None = None,
                 max_block_s: float = DEFAULT_MAX_BLOCK_S) -> None:
        super().__init__(zmq.PULL, bind_host=bind_host, address=address,
                         max_block_s=max_block_s)

    def dequeue(self, timeout: float | None = None, abort: Abort | None = None
                ) -> list[memoryview]:
        """The next message's frames; ShmQueueClosed once the sender closed."""
        self._wait(zmq.POLLIN, "receive", timeout, abort)
        parts = self._socket.recv_multipart(copy=False)
        if len(parts) == 1 and parts[0].bytes == CLOSED:
            self.close()
            raise ShmQueueClosed(f"zmq channel {self.address} was closed by its sender")
        return [part.buffer for part in parts]

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
