"""Engine-core clients: one interface over an in-process EngineCore or an engine-core process.

- `InprocClient`: the EngineCore in the caller's process; `get_output()` runs one step.
- `MPClient`: starts `run_engine_core` (mrv2/core/core_proc.py) in a spawned process and talks
  to it over ZMQ ipc sockets with msgspec messages. A reader thread decodes outputs into a
  queue, so decoding overlaps the caller; `get_output()` takes the next batch from it.
- `AsyncMPClient` (mrv2/engine/async_client.py): the same over zmq.asyncio, for an event loop
  (AsyncLLM). `MPClientBase` here holds what the two share: the process, sockets and failure.

Requests are sent without waiting for an answer. A request the core refuses comes back as a
`RequestRejectedError`, raised by the `get_output` that reaches it (in process, `add_request`
raises at once).

Failure: a monitor thread waits on the process sentinel. When the process dies (or reports its
own failure, with the traceback) the client is dead: every caller waiting in `get_output*` or a
utility call gets `EngineDeadError` at once, and every later call raises it immediately.
`shutdown()` stops the process (SHUTDOWN message, death pipe, then SIGTERM / SIGKILL), closes
the sockets and removes the ipc directory; it is idempotent and also runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import queue
import shutil
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from executor.process import pipe, settle
from mrv2.config import EngineConfig
from mrv2.core.core_proc import CoreProcess, call_utility, core_stats
from mrv2.errors import EngineDeadError, WorkerError
from mrv2.core_framing import (ABORT, ADD, DEAD, OUTPUTS, REJECTED, SHUTDOWN, UTILITY,
                               UTILITY_RESULT, CoreFraming)
from mrv2.engine.core_handle import CoreHandle, CoreLauncher, bind_core_socket
from mrv2.protocol import (CoreStats, EngineCoreOutputs, EngineCoreRequest, UtilityCall,
                           UtilityResult)

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 300.0
SHUTDOWN_GRACE_S = 5.0
# After the process exits, how long the monitor waits for the core's own DEAD report (which
# carries the traceback) before failing the client with the bare exit code.
DEAD_REPORT_GRACE_S = 1.0
SEND_POLL_MS = 100
CLIENT_DEAD = object()  # queued to wake readers when the client dies


class RequestRejectedError(ValueError):
    """The engine core refused a request (its add_request raised)."""

    def __init__(self, request_id: str, message: str, exc_type: str = "") -> None:
        super().__init__(f"request {request_id!r} was rejected by the engine core: {message}")
        self.request_id = request_id
        self.exc_type = exc_type


class EngineCoreClient:
    """What the front ends (LLMEngine, AsyncLLM) need from an engine core."""

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next outputs. A core process: block up to `timeout` (None: until some arrive;
        empty outputs on timeout). In process: run one step."""
        raise NotImplementedError

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def get_stats(self) -> CoreStats:
        return msgspec.convert(self.call_utility("get_stats"), CoreStats)

    @property
    def is_dead(self) -> bool:
        return False

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, executor_class: type | None = None) -> None:
        from mrv2.core.engine_core import EngineCore

        self.engine_core = EngineCore(config, executor_class)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return call_utility(self.engine_core, method, args)

    def get_stats(self) -> CoreStats:
        return core_stats(self.engine_core)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


_LIVE_CLIENTS: set["MPClientBase"] = set()


@atexit.register
def _shutdown_live_clients() -> None:
    for client in list(_LIVE_CLIENTS):
        client.shutdown()


def utility_value(method: str, reply: UtilityResult) -> Any:
    if reply.error is not None:
        raise WorkerError(f"engine core utility {method!r} raised {reply.exc_type}: "
                          f"{reply.error}", exc_type=reply.exc_type,
                          remote_traceback=reply.traceback)
    return reply.result


class MPClientBase(EngineCoreClient):
    """The core process and its transport; subclasses add sync or asyncio I/O."""

    def __init__(self, config: EngineConfig, *, asyncio_mode: bool,
                 executor_class: type | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 core_launcher: CoreLauncher | None = None) -> None:
        self._dead: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._dead_event = threading.Event()
        self._ids = itertools.count()
        self._utility: dict[int, Any] = {}  # call id -> future of its UtilityResult
        self._framing = CoreFraming()
        self.process: CoreHandle | None = None
        self._monitor: threading.Thread | None = None
        self.ipc_dir = tempfile.mkdtemp(prefix="mrv2-core-")
        bind_host = None if core_launcher is None else core_launcher.bind_host
        self.ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        input_addr = bind_core_socket(self.input_socket, bind_host, f"{self.ipc_dir}/input")
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        output_addr = bind_core_socket(self.output_socket, bind_host, f"{self.ipc_dir}/output")
        self._wake_r, self._wake_w = pipe()
        self._init_io()
        _LIVE_CLIENTS.add(self)
        try:
            self.process = (CoreProcess if core_launcher is None else core_launcher)(
                config, input_addr, output_addr, executor_class)
            self.ready = self.process.wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = self.process.watch(self._wake_r, self._on_exit)

    @property
    def proc(self) -> mp.process.BaseProcess | None:
        """The core's process, when it is a process of this one (not a Ray actor)."""
        return getattr(self.process, "proc", None)

    # -- failure -----------------------------------------------------------------------------

    def _on_exit(self) -> None:
        if self._closed:
            return
        self._dead_event.wait(DEAD_REPORT_GRACE_S)
        self._fail(self.process.exit_text())

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
        self._dead_event.set()
        logger.error("engine core client failed: %s", reason)
        self._wake_waiters()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    @property
    def is_dead(self) -> bool:
        """True once the core process died or the client was shut down."""
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _fail_utility_calls(self) -> None:
        error = EngineDeadError(self._dead)
        for future in list(self._utility.values()):
            settle(future, error=error)

    # -- messages ----------------------------------------------------------------------------

    def _encode(self, kind: bytes, message: Any) -> tuple[bytes, bytes]:
        return self._framing.encode(kind, message)

    def _dispatch(self, frames) -> None:
        """Route one message from the core (on the reader thread or task)."""
        kind = frames[0].bytes
        if kind not in (OUTPUTS, UTILITY_RESULT, REJECTED, DEAD):
            raise ValueError(f"message type {kind!r} is not one the engine core sends")
        message = self._framing.decode(kind, frames[1].buffer)
        if kind == OUTPUTS:
            self._put_output(message)
        elif kind == UTILITY_RESULT:
            future = self._utility.get(message.call_id)
            if future is not None:
                settle(future, message)
        elif kind == REJECTED:
            self._put_output(RequestRejectedError(message.request_id, message.message,
                                                  message.exc_type))
        else:  # DEAD: the core failed and is exiting
            self._fail(message.reason)

    def _unwrap(self, item: Any) -> EngineCoreOutputs:
        """What a reader took from the output queue: outputs, or the error to raise."""
        if item is CLIENT_DEAD:
            self._put_output(CLIENT_DEAD)  # for the next waiter
            raise EngineDeadError(self._dead)
        if isinstance(item, RequestRejectedError):
            raise item
        return item

    # -- shutdown ----------------------------------------------------------------------------

    def shutdown(self, timeout: float = SHUTDOWN_GRACE_S) -> None:
        """Stop the process and release everything. Idempotent; waiting callers get
        EngineDeadError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._dead is None:
                self._dead = "the engine core client was shut down"
        self._dead_event.set()
        if self.process is not None:
            if self.process.is_alive():
                try:
                    self._send_shutdown()
                except Exception:  # the death pipe and signals remain
                    pass
            self.process.stop(timeout)
        self._wake_w.close()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(2.0)
        self._wake_r.close()
        self._wake_waiters()
        self._close_io()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        _LIVE_CLIENTS.discard(self)

    def _send_shutdown(self) -> None:
        sock = zmq.Socket.shadow(self.input_socket.underlying)
        sock.send_multipart(self._framing.encode(SHUTDOWN), flags=zmq.NOBLOCK)

    # -- subclass I/O ------------------------------------------------------------------------

    def _init_io(self) -> None:
        raise NotImplementedError

    def _put_output(self, item: Any) -> None:
        raise NotImplementedError

    def _wake_waiters(self) -> None:
        raise NotImplementedError

    def _close_io(self) -> None:
        raise NotImplementedError


class MPClient(MPClientBase):
    """Synchronous client of an engine-core process. Thread-safe."""

    def __init__(self, config: EngineConfig, *, executor_class: type | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        super().__init__(config, asyncio_mode=False, executor_class=executor_class,
                         startup_timeout_s=startup_timeout_s)

    def _init_io(self) -> None:
        self._outputs: queue.Queue = queue.Queue()
        self._send_lock = threading.Lock()
        stop_addr = f"inproc://mrv2-client-stop-{id(self)}"
        self._stop_r = self.ctx.socket(zmq.PAIR)
        self._stop_r.bind(stop_addr)
        self._stop_w = self.ctx.socket(zmq.PAIR)
        self._stop_w.connect(stop_addr)
        self._reader = threading.Thread(target=self._read_outputs, name="mrv2-client-output",
                                        daemon=True)
        self._reader.start()

    def _read_outputs(self) -> None:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._stop_r in events:
                    return
                self._dispatch(self.output_socket.recv_multipart(copy=False))
        except zmq.ContextTerminated:
            pass
        except Exception:
            self._fail(f"the client could not read the engine core's output:\n"
                       f"{traceback.format_exc()}")

    def _put_output(self, item: Any) -> None:
        self._outputs.put(item)

    def _wake_waiters(self) -> None:
        self._outputs.put(CLIENT_DEAD)
        self._fail_utility_calls()

    def _close_io(self) -> None:
        if self._reader.is_alive():
            self._stop_w.send(b"")
            self._reader.join(2.0)
        if self._reader.is_alive():  # never seen; leave its sockets to process exit
            return
        self.ctx.destroy(linger=0)

    def _send(self, kind: bytes, message: Any) -> None:
        with self._send_lock:
            self._check_alive()
            frames = self._encode(kind, message)
            while True:
                try:
                    self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:  # no connected peer (yet, or any more)
                    self.input_socket.poll(SEND_POLL_MS, zmq.POLLOUT)
                    self._check_alive()

    def _send_shutdown(self) -> None:
        if self._send_lock.acquire(timeout=1.0):
            try:
                super()._send_shutdown()
            finally:
                self._send_lock.release()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(ABORT, list(request_ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        self._check_alive()
        try:
            item = self._outputs.get(timeout=timeout) if timeout != 0 else \
                self._outputs.get_nowait()
        except queue.Empty:
            return EngineCoreOutputs(timestamp=time.monotonic())
        return self._unwrap(item)

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        call_id = next(self._ids)
        future: Future = Future()
        self._utility[call_id] = future
        try:
            self._send(UTILITY, UtilityCall(call_id, method, list(args)))
            reply = future.result(timeout)
        finally:
            self._utility.pop(call_id, None)
        return utility_value(method, reply)
