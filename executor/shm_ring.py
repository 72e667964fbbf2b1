"""The ring under executor/shm_queue.py: the shared parameters and errors, the segment's
layout, the wait loop, and the layout of one message in a chunk. See shm_queue.py for the
protocol."""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Callable, Sequence
from multiprocessing.shared_memory import SharedMemory

import msgspec
import zmq

DEFAULT_NUM_CHUNKS = 10
DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_SPIN_S = 5e-4
DEFAULT_MAX_SLEEP_S = 5e-4
DEFAULT_MAX_BLOCK_S = 0.02
# A reader re-checks its chunk this many times inline (~10 us, no clock reads or yields)
# before the wait loop, whose spin yields the CPU between checks: a step's reply usually
# lands within microseconds, and a process that shares its core with the one it waits for
# (2 cores, 3 processes) must yield soon, or each hop costs the whole pure spin.
QUICK_CHECKS = range(200)
_HEADER_BYTES = 64
_ALIGN = 16

Frames = Sequence[bytes | bytearray | memoryview]
Abort = Callable[[], None]  # called between sleeps; raises to abandon the wait


class ShmQueueTimeout(TimeoutError):
    """A wait on the queue exceeded its timeout."""


class ShmQueueClosed(EOFError):
    """The writer closed the queue and no message is left to read."""


class ShmQueueHandle(msgspec.Struct, array_like=True, frozen=True):
    """Everything a reader in another process needs to connect (msgpack- and pickle-able)."""

    name: str
    num_readers: int
    num_chunks: int
    chunk_bytes: int
    zmq_address: str  # overflow messages (XPUB -> SUB)
    wake_address: str  # wake-ups: reader r binds a datagram socket at wake_address + "-<r>"


def align(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


class Ring:
    """The segment, its layout, and the wait loop shared by writer and readers."""

    def __init__(self, handle: ShmQueueHandle, shm: SharedMemory, sockets: list[zmq.Socket],
                 spin_s: float, max_sleep_s: float, max_block_s: float) -> None:
        self.handle, self._shm = handle, shm
        self.name, self.num_readers = handle.name, handle.num_readers
        self.num_chunks, self.chunk_bytes = handle.num_chunks, handle.chunk_bytes
        self.spin_s, self.max_sleep_s, self.max_block_s = spin_s, max_sleep_s, max_block_s
        self._sleepers, self._stride, self._data_off = self._layout(self.num_readers,
                                                                    self.num_chunks)
        self._buf: memoryview | None = shm.buf
        # Per-chunk offsets, computed once: the step path does no layout arithmetic.
        self._flag_offs = [self._flags(i) for i in range(self.num_chunks)]
        self._data_offs = [self._data(i) for i in range(self.num_chunks)]
        self._index = 0  # next chunk this end writes or reads
        self._seq = 0  # sequence number of the next message
        self._sockets = sockets

    @staticmethod
    def _layout(num_readers: int, num_chunks: int) -> tuple[int, int, int]:
        """Offsets: sleepers, flag-row stride, data."""
        sleepers = _HEADER_BYTES
        flags = sleepers + align(num_readers, 64)
        stride = align(2 + num_readers, 8)
        return sleepers, stride, flags + align(num_chunks * stride, 64)

    @classmethod
    def segment_size(cls, num_readers: int, num_chunks: int, chunk_bytes: int) -> int:
        return cls._layout(num_readers, num_chunks)[2] + num_chunks * chunk_bytes

    def _flags(self, i: int) -> int:
        return self._sleepers + align(self.num_readers, 64) + i * self._stride

    def _data(self, i: int) -> int:
        return self._data_off + i * self.chunk_bytes

    def _wait(self, ready: Callable[[], bool], timeout: float | None, abort: Abort | None,
              on_timeout: Callable[[float], Exception],
              on_idle: Callable[[], None] | None = None, block: Callable[[float], None] | None
              = None) -> None:
        """Spin, then sleep with back-off (or `block(seconds)` while that is given) until
        `ready()`; `abort` and `on_idle` run between sleeps; past `timeout`, raise."""
        if ready():
            return
        start = time.monotonic()
        sleep = 1e-5
        while not ready():
            now = time.monotonic()
            if timeout is not None and now - start >= timeout:
                raise on_timeout(now - start)
            if now - start < self.spin_s:
                os.sched_yield()
                continue
            if abort is not None:
                abort()
            if on_idle is not None:
                on_idle()
            left = math.inf if timeout is None else timeout - (now - start)
            if block is not None:
                block(min(left, self.max_block_s))
            else:
                time.sleep(min(sleep, self.max_sleep_s, left))
                sleep *= 2

    def _close_mapping(self) -> None:
        self._buf = None
        try:
            self._shm.close()
        except BufferError:  # a view is still exported somewhere: the mapping dies with it
            pass
        for zmq_socket in self._sockets:
            zmq_socket.close(linger=0)
        self._sockets = []


# A message's header at the start of its chunk: sequence number, bytes used (0: overflow),
# frame count (padded to 8 bytes), then one length per frame.
MESSAGE_HEADER = struct.Struct("<qqI4x")
_HEADERS: dict[int, struct.Struct] = {}


def message_header(count: int) -> struct.Struct:
    header = _HEADERS.get(count)
    if header is None:
        header = _HEADERS[count] = struct.Struct(f"{MESSAGE_HEADER.format}{count}Q")
    return header


ONE_FRAME_HEADER = message_header(1)
ONE_FRAME_AT = align(ONE_FRAME_HEADER.size)  # where a message's only frame starts


def layout_frames(frames: Frames) -> tuple[list, list[int], int]:
    """Views of the frames' bytes, their offsets behind the header (16-byte aligned), and
    the bytes the message uses in a chunk."""
    views = [f if type(f) is bytes else memoryview(f).cast("B") for f in frames]
    offsets, end = [], align(message_header(len(views)).size)
    for v in views:
        offsets.append(end)
        end = align(end + len(v))
    return views, offsets, end


def split_frames(mv: memoryview, count: int) -> list[memoryview]:
    """The frames of a private copy of a message (header included)."""
    lengths = message_header(count).unpack_from(mv, 0)[3:]
    frames, pos = [], align(message_header(count).size)
    for n in lengths:
        frames.append(mv[pos:pos + n])
        pos = align(pos + n)
    return frames
