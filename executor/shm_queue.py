"""Shared-memory message queue: one writer, N readers, a ring of chunks, ZMQ for big messages.

Segment layout (one `multiprocessing.shared_memory` segment per queue, named
`<prefix>_<pid>_<uuid>` so two engines on a machine never collide):

    header    64 bytes         byte 0: closed (the writer has gone)
    sleepers  N bytes (pad 64) reader r is blocked waiting for a wake-up
    flags     num_chunks rows  [written, overflow, read_0 .. read_{N-1}], padded to 8 bytes
    data      num_chunks x chunk_bytes, each starting with the message's header:
              sequence number, bytes used (int64 each), frame count, pad (uint32 each),
              frame lengths (uint64 each); then the frames, 16-byte aligned

Writer, chunk i: wait until it was never written or every reader has read it (no reader
takes such a chunk for a message); write the header and payload; fence; clear the read flags
and set `written` (publish); fence; check the sleepers. Reader r, its chunk i: ready when
`written` is set and `read_r` is clear; fence; read; fence; set `read_r`. All state lives in
the flags, so no wake-up can be lost.

Waiting: spin briefly (`spin_s`, yielding the CPU), then wait in bounded steps. A waiting
reader sets its `sleepers` byte, re-checks its chunk, and then blocks on its own Unix datagram
socket (abstract namespace on Linux: no file) for at most `max_block_s`; a writer that finds a
sleeper after publishing sends it a one-byte wake-up (a direct kernel wake-up, no I/O thread).
Set-then-check on both sides, with a fence between, means that either the reader sees the
message or the writer sees the sleeper; the bounded block is the safety net, and where abort
callbacks and the closed flag are checked. A writer waiting for a free chunk sleeps with
exponential back-off up to `max_sleep_s`.

Segments are created by the writer and unlinked by it on close; readers attach without
registering them with their resource tracker (executor/shm_segment.py).

A message is a list of frames (see executor/serial.py), laid out in the chunk at 16-byte
aligned offsets behind its header; readers get private copies (a one-frame message: a copy
of the frame alone). A message that does not
fit a chunk goes over a ZMQ XPUB/SUB socket on tcp://127.0.0.1 and its chunk is marked
`overflow` (the chunk still orders and flow-controls it).
"""

from __future__ import annotations

import os
import select
import socket
import sys
import tempfile
import time
import uuid
from multiprocessing.shared_memory import SharedMemory

import zmq

from executor.shm_ring import (DEFAULT_CHUNK_BYTES, DEFAULT_MAX_BLOCK_S, DEFAULT_MAX_SLEEP_S,
                                DEFAULT_NUM_CHUNKS, DEFAULT_SPIN_S, MESSAGE_HEADER, ONE_FRAME_AT,
                                ONE_FRAME_HEADER, QUICK_CHECKS, Abort, Frames, Ring,
                                ShmQueueClosed, ShmQueueHandle, ShmQueueTimeout, layout_frames,
                                message_header, split_frames)
from executor.shm_segment import attach_segment, fence, fence_acquire, fence_release

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_MAX_BLOCK_S", "DEFAULT_MAX_SLEEP_S",
           "DEFAULT_NUM_CHUNKS", "DEFAULT_SPIN_S", "ShmQueueClosed", "ShmQueueHandle",
           "ShmQueueReader", "ShmQueueTimeout", "ShmQueueWriter"]


def _wake_prefix(name: str) -> str:
    """Where readers bind their wake-up sockets: the abstract namespace on Linux (nothing on
    disk), a file in the temp dir elsewhere (removed by the reader on close)."""
    if sys.platform.startswith("linux"):
        return f"\0{name}-wake"
    return os.path.join(tempfile.gettempdir(), f"{name}-wake")


def _new_socket(kind: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class ShmQueueWriter(Ring):
    """The writing end; creates (and on close unlinks) the segment."""

    def __init__(self, num_readers: int, num_chunks: int = DEFAULT_NUM_CHUNKS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, *, spin_s: float = DEFAULT_SPIN_S,
                 max_sleep_s: float = DEFAULT_MAX_SLEEP_S, name_prefix: str = "mrv2") -> None:
        if num_readers < 1 or num_chunks < 1 or chunk_bytes < 64:
            raise ValueError(f"need num_readers >= 1, num_chunks >= 1 and chunk_bytes >= 64, "
                             f"got {num_readers}, {num_chunks}, {chunk_bytes}")
        name = f"{name_prefix}_{os.getpid()}_{uuid.uuid4().hex[:16]}"
        size = self.segment_size(num_readers, num_chunks, chunk_bytes)
        shm = SharedMemory(name=name, create=True, size=size)  # zero-filled
        overflow = _new_socket(zmq.XPUB)
        overflow.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per reader
        overflow.setsockopt(zmq.SNDHWM, 0)  # never drop: the ring already bounds what is queued
        handle = ShmQueueHandle(
            name, num_readers, num_chunks, chunk_bytes,
            f"tcp://127.0.0.1:{overflow.bind_to_random_port('tcp://127.0.0.1')}",
            _wake_prefix(name))
        super().__init__(handle, shm, [overflow], spin_s, max_sleep_s, DEFAULT_MAX_BLOCK_S)
        self._overflow = overflow
        self._wake = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._wake.setblocking(False)
        self._wake_addresses = [f"{handle.wake_address}-{r}" for r in range(num_readers)]
        self._subscribers = 0
        self._all_read = b"\x01" * num_readers
        self._none_read = self._no_sleepers = bytes(num_readers)
        # Views of each chunk's read flags and of the sleepers bytes, made once: comparing or
        # assigning a standing view costs a third of slicing the segment each time. Released
        # before the mapping is closed.
        buf, nr = self._buf, num_readers
        self._read_flags = [buf[f + 2:f + 2 + nr] for f in self._flag_offs]
        self._asleep_flags = buf[self._sleepers:self._sleepers + nr]
        self._closed = self._unlinked = False

    def unread_by(self, i: int) -> list[int]:
        """Readers that have not read chunk i (which is written)."""
        off = self._flags(i) + 2
        return [r for r in range(self.num_readers) if not self._buf[off + r]]

    def enqueue(self, frames: Frames | bytes, timeout: float | None = None,
                abort: Abort | None = None) -> None:
        if self._closed:
            raise ShmQueueClosed(f"shm queue {self.name} is closed")
        if isinstance(frames, (bytes, bytearray, memoryview)):
            frames = (frames,)
        # bytes copy into the segment as they are; anything else as its raw bytes.
        if len(frames) == 1:  # the common case, laid out without a loop
            f = frames[0]
            views = (f if type(f) is bytes else memoryview(f).cast("B"),)
            offsets, end = None, ONE_FRAME_AT + len(views[0])
        else:
            views, offsets, end = layout_frames(frames)
        i, seq, buf = self._index, self._seq, self._buf
        flags, read_flags = self._flag_offs[i], self._read_flags[i]
        start = None if timeout is None else time.monotonic()
        if buf[flags] and read_flags != self._all_read:
            self._wait_until_read(i, seq, timeout, abort)
        # Chunk i is free: never written, or `written` and every read flag set, which no
        # reader takes for a message. It stays so until the read flags are cleared below.
        data, overflow = self._data_offs[i], end > self.chunk_bytes
        if overflow:
            left = None if start is None else max(0.0, timeout - (time.monotonic() - start))
            self._await_subscribers(left, abort)
            # Copied by zmq: the caller may reuse its buffers as soon as enqueue returns.
            self._overflow.send_multipart([seq.to_bytes(8, "little"), *views])
            MESSAGE_HEADER.pack_into(buf, data, seq, 0, 0)
        elif offsets is None:
            ONE_FRAME_HEADER.pack_into(buf, data, seq, end, 1, end - ONE_FRAME_AT)
            buf[data + ONE_FRAME_AT:data + end] = views[0]
        else:
            message_header(len(views)).pack_into(buf, data, seq, end, len(views), *map(len, views))
            for v, o in zip(views, offsets):
                buf[data + o:data + o + len(v)] = v
        buf[flags + 1] = overflow
        fence_acquire()  # header and payload before the publishing stores
        fence_release()
        # Publish: on the first lap `written` does (the read flags are clear already), on
        # later laps clearing the read flags does (`written` stays set). Either order of
        # the two stores is safe: a reader needs both, and both follow the payload.
        read_flags[:] = self._none_read
        buf[flags] = 1
        self._index = i + 1 if i + 1 < self.num_chunks else 0
        self._seq = seq + 1
        fence_acquire()  # publish before the sleepers check (a reader sets its byte, then
        fence_release()  # checks): either it sees the message or we see it asleep
        if self._asleep_flags != self._no_sleepers:
            self._wake_sleepers()

    def _wait_until_read(self, i: int, seq: int, timeout: float | None,
                         abort: Abort | None) -> None:
        """Wait until every reader has read chunk i (the ring is full)."""
        buf, flags, nr = self._buf, self._flag_offs[i], self.num_readers
        self._wait(lambda: not buf[flags] or buf[flags + 2:flags + 2 + nr] == self._all_read,
                   timeout, abort,
                   lambda waited: ShmQueueTimeout(
                       f"shm queue {self.name}: chunk {i} (message {seq - self.num_chunks}) is "
                       f"still unread by reader(s) {self.unread_by(i)} of {nr} after "
                       f"{waited:.2f} s"))

    def _wake_sleepers(self) -> None:
        buf = self._buf
        for r, address in enumerate(self._wake_addresses):
            if buf[self._sleepers + r]:
                try:
                    self._wake.sendto(b"\x01", address)
                except OSError:  # not bound yet, gone, or its buffer is full of wake-ups
                    pass

    def _await_subscribers(self, timeout: float | None, abort: Abort | None) -> None:
        def poll() -> None:
            while self._overflow.poll(0):
                event = self._overflow.recv()
                self._subscribers += 1 if event[:1] == b"\x01" else -1

        def on_timeout(waited: float) -> Exception:
            return ShmQueueTimeout(
                f"shm queue {self.name}: only {self._subscribers} of {self.num_readers} readers "
                f"connected to the overflow socket {self.handle.zmq_address} after "
                f"{waited:.2f} s")

        self._wait(lambda: self._subscribers >= self.num_readers, timeout, abort, on_timeout,
                   on_idle=poll)

    def unlink(self) -> None:
        """Mark the queue closed and remove its name; the mapping stays valid for this
        process (safe while another thread is still inside enqueue)."""
        if self._buf is not None:
            self._buf[0] = 1
            fence()
            self._wake_sleepers()  # blocked readers see `closed` now, not after a block
        if not self._unlinked:
            self._unlinked = True
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Mark the queue closed (readers drain, then get ShmQueueClosed), unlink it and unmap
        it. Idempotent."""
        if self._closed:
            return
        self.unlink()
        self._closed = True
        for view in (*self._read_flags, self._asleep_flags):
            view.release()
        self._close_mapping()
        self._wake.close()


class ShmQueueReader(Ring):
    """Reader `rank` of a queue created elsewhere (any process)."""

    def __init__(self, handle: ShmQueueHandle, rank: int, *, spin_s: float = DEFAULT_SPIN_S,
                 max_block_s: float = DEFAULT_MAX_BLOCK_S) -> None:
        if not 0 <= rank < handle.num_readers:
            raise ValueError(f"reader rank {rank} is outside [0, {handle.num_readers})")
        self._overflow = _new_socket(zmq.SUB)
        super().__init__(handle, attach_segment(handle.name), [self._overflow], spin_s,
                         DEFAULT_MAX_SLEEP_S, max_block_s)
        self.rank = rank
        self._overflow.setsockopt(zmq.RCVHWM, 0)
        self._overflow.setsockopt(zmq.SUBSCRIBE, b"")
        self._overflow.connect(handle.zmq_address)
        self._wake_address = f"{handle.wake_address}-{rank}"
        self._wake = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._wake.bind(self._wake_address)
        self._asleep = self._sleepers + rank

    def _block(self, seconds: float) -> None:
        """Mark this reader asleep (the caller re-checks before the next block), then wait
        for a wake-up for at most `seconds`."""
        buf = self._buf
        if not buf[self._asleep]:
            buf[self._asleep] = 1
            fence()
            return  # re-check readiness once more before blocking: the writer may have missed us
        if select.select([self._wake], [], [], seconds)[0]:
            try:
                while True:  # drain: one wake-up may stand for several messages
                    self._wake.recv(16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass

    def dequeue(self, timeout: float | None = None, abort: Abort | None = None
                ) -> list[memoryview]:
        """The next message's frames, in private writable buffers."""
        buf = self._buf
        if buf is None:
            raise ShmQueueClosed(f"shm queue {self.name}: reader {self.rank} is closed")
        i, seq = self._index, self._seq
        flags = self._flag_offs[i]
        mine = flags + 2 + self.rank
        start = None if timeout is None else time.monotonic()
        if not buf[flags] or buf[mine]:  # not written yet, or still last lap's (read)
            # A step's reply usually lands within microseconds: re-check inline first (about
            # 50 ns a check), before the wait loop and its closures and clock reads.
            for _ in QUICK_CHECKS:
                if buf[flags] and not buf[mine]:
                    break
            else:
                self._wait_until_written(i, seq, timeout, abort)
        fence_acquire()  # the flags before the payload
        fence_release()
        data = self._data_offs[i]
        # Reads the first frame's length too: always inside the chunk, meaningless (and
        # unused) unless the count is 1.
        got_seq, nbytes, count, first = ONE_FRAME_HEADER.unpack_from(buf, data)
        if got_seq != seq:
            raise RuntimeError(f"shm queue {self.name}: reader {self.rank} expected message "
                               f"{seq} in chunk {i}, found {got_seq}")
        if buf[flags + 1]:
            left = None if start is None else max(0.0, timeout - (time.monotonic() - start))
            frames = self._recv_overflow(i, seq, left, abort)
        elif count == 1:
            start_at = data + ONE_FRAME_AT
            frames = [memoryview(bytearray(buf[start_at:start_at + first]))]
        else:
            frames = split_frames(memoryview(bytearray(buf[data:data + nbytes])), count)
        fence_acquire()  # done reading before the writer may reuse the chunk
        fence_release()
        buf[mine] = 1
        self._index = i + 1 if i + 1 < self.num_chunks else 0
        self._seq = seq + 1
        return frames

    def _wait_until_written(self, i: int, seq: int, timeout: float | None,
                            abort: Abort | None) -> None:
        """Spin, then block with wake-ups, until chunk i holds a message this reader has not
        read; ShmQueueClosed once the writer has gone and nothing is left."""
        buf = self._buf
        flags = self._flag_offs[i]
        mine = flags + 2 + self.rank

        def closed() -> None:
            if buf[0] and not (buf[flags] and not buf[mine]):
                raise ShmQueueClosed(f"shm queue {self.name} was closed by its writer")

        try:
            self._wait(lambda: buf[flags] and not buf[mine], timeout, abort,
                       lambda waited: ShmQueueTimeout(
                           f"shm queue {self.name}: reader {self.rank} waited {waited:.2f} s "
                           f"for chunk {i} (message {seq}); the writer has not written it"),
                       on_idle=closed, block=self._block)
        finally:
            buf[self._asleep] = 0

    def _recv_overflow(self, i: int, seq: int, timeout: float | None, abort: Abort | None
                       ) -> list[memoryview]:
        self._wait(lambda: bool(self._overflow.poll(0)), timeout, abort,
                   lambda waited: ShmQueueTimeout(
                       f"shm queue {self.name}: reader {self.rank} waited {waited:.2f} s for "
                       f"overflow message {seq} of chunk {i} on {self.handle.zmq_address}"))
        parts = self._overflow.recv_multipart(copy=False)
        got = int.from_bytes(parts[0].bytes, "little")
        if got != seq:
            raise RuntimeError(f"shm queue {self.name}: reader {self.rank} expected overflow "
                               f"message {seq}, got {got}")
        return [part.buffer for part in parts[1:]]

    def close(self) -> None:
        if self._buf is not None:
            self._close_mapping()
            self._wake.close()
            if not self._wake_address.startswith("\0"):  # a file outside Linux
                try:
                    os.unlink(self._wake_address)
                except FileNotFoundError:
                    pass
