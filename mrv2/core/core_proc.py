"""The engine core in its own process: a busy loop around EngineCore, driven over ZMQ.

`run_engine_core` is the target of a spawned process (mrv2/engine/client.py starts it). The
client binds two ipc sockets; the core connects a PULL socket to the input address and a PUSH
socket to the output address. Every message is two frames, a one-byte code and a msgpack body
(msgspec; nothing is pickled); the codes and their framing (`CoreFraming`) are in
mrv2/core_framing.py, the types in mrv2/protocol.py:

    client -> core   ADD EngineCoreRequest | ABORT list[str] | UTILITY UtilityCall | SHUTDOWN
    core -> client   OUTPUTS EngineCoreOutputs | UTILITY_RESULT UtilityResult
                     | REJECTED RequestRejected
                     | DEAD CoreDead (the core failed; the traceback, sent before it exits)

Threads in the core process:
- main: drains the input queue, steps the core while it has work, and blocks on the input queue
  when it has none (an idle core uses no CPU); sends outputs. Only it touches the EngineCore.
- input: receives and decodes messages into the input queue, overlapping with the step.
- death pipe: the parent holds the only write end, so EOF means the parent is gone; the loop is
  told to stop, and the process exits after a grace period regardless.

Start-up: `CoreReady` over `ready_conn`, with the traceback text if the core could not be built.
A request the scheduler refuses (`add_request` raised) is answered with REJECTED, not fatal.
`CoreProcess` is the parent's side: spawn, wait for ready, stop.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from executor.process import (pipe, report_ready, spawn, stop_processes, wait_ready,
                              watch_parent, watch_processes)
from mrv2.core_framing import (ABORT, ADD, DEAD, OUTPUTS, REJECTED, SHUTDOWN, UTILITY,
                               UTILITY_RESULT, CoreFraming)
from mrv2.errors import EngineDeadError
from mrv2.protocol import CoreDead, CoreReady, CoreStats, RequestRejected, UtilityResult
from mrv2.utils import free_cores

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from mrv2.core.engine_core import EngineCore

# Internal to the core process: put on the input queue, never sent.
_PARENT_GONE, _BAD_INPUT, _EXECUTOR_FAILED = b"parent-gone", b"bad-input", b"executor-failed"

PARENT_GONE_GRACE_S = 5.0
OUTPUT_FLUSH_S = 3.0


def core_stats(core: "EngineCore") -> CoreStats:
    sched = core.scheduler
    prefix = sched.prefix_cache_stats
    return CoreStats(
        num_running=sched.num_running, num_waiting=sched.num_waiting,
        num_unfinished=sched.get_num_unfinished_requests(),
        has_unfinished=core.has_unfinished_requests(), kv_cache_usage=sched.kv_cache_usage,
        num_free_blocks=sched.kv_cache_manager.num_free_blocks,
        num_kv_blocks=core.executor.num_kv_blocks, num_preemptions=sched.num_preemptions,
        prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
        spec_decode=sched.spec_stats.totals if sched.speculative is not None else [])


# Utility calls a client may make: name -> function(core, *args). Results must be msgpack-able.
UTILITIES = {
    "get_stats": core_stats,
    "reset_prefix_cache": lambda core: core.scheduler.reset_prefix_cache(),
    "sleep": lambda core, level=1: core.sleep(level),
    "wake_up": lambda core, tags=None: core.wake_up(tags),
    "is_sleeping": lambda core: core.sleep_level > 0,
    "echo": lambda core, *args: list(args),
}


def call_utility(core: "EngineCore", method: str, args: list[Any] | tuple = ()) -> Any:
    function = UTILITIES.get(method)
    if function is None:
        raise AttributeError(f"unknown engine core utility {method!r}; "
                             f"known: {', '.join(sorted(UTILITIES))}")
    return function(core, *args)


class EngineCoreProc:
    """The core process's state: the EngineCore, its queues and its I/O threads."""

    def __init__(self, core: "EngineCore", input_queue: queue.Queue, input_addr: str,
                 output_addr: str) -> None:
        self.core = core
        self.input_queue = input_queue
        self.stopping = False
        self.ctx = zmq.Context()
        input_socket = self.ctx.socket(zmq.PULL)
        input_socket.setsockopt(zmq.RCVHWM, 0)
        input_socket.connect(input_addr)
        # Outputs are sent from the main thread: encoding and sending one step's outputs
        # takes ~0.1 ms, less than handing them to an output thread that must then take the
        # GIL from the step loop.
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket.setsockopt(zmq.LINGER, int(OUTPUT_FLUSH_S * 1000))
        self.output_socket.connect(output_addr)
        self.framing = CoreFraming()
        self.input_thread = threading.Thread(target=self._input_loop, args=(input_socket,),
                                             name="mrv2-core-input", daemon=True)
        self.input_thread.start()
        # A worker that dies while the core is idle (blocked on this queue) fails it at once.
        core.executor.register_failure_callback(
            lambda reason: input_queue.put((_EXECUTOR_FAILED, reason)))

    def _input_loop(self, sock: zmq.Socket) -> None:
        """Receive and decode client messages into the input queue (overlapping the step)."""
        framing = CoreFraming()  # this thread's decoders
        try:
            while True:
                kind, body = sock.recv_multipart(copy=False)
                kind = kind.bytes
                if kind not in (ADD, ABORT, UTILITY, SHUTDOWN):
                    raise ValueError(f"message type {kind!r} is not one a client sends")
                self.input_queue.put((kind, framing.decode(kind, body.buffer)))
        except zmq.ContextTerminated:
            pass
        except Exception:
            self.input_queue.put((_BAD_INPUT, traceback.format_exc()))
        finally:
            sock.close(linger=0)

    def send(self, kind: bytes, message: Any) -> None:
        self.output_socket.send_multipart(self.framing.encode(kind, message), copy=False)

    # -- the busy loop ---------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        core = self.core
        while not self.stopping:
            # Idle: block until a message arrives (no spinning). Busy: take what is there.
            while not self.stopping and not core.has_unfinished_requests():
                self._handle(*self.input_queue.get())
            while not self.stopping:
                try:
                    item = self.input_queue.get_nowait()
                except queue.Empty:
                    break
                self._handle(*item)
            if self.stopping:
                break
            outputs = core.step()
            if outputs.outputs:
                self.send(OUTPUTS, outputs)

    def _handle(self, kind: bytes, message: Any) -> None:
        if kind == ADD:
            try:
                self.core.add_request(message)
            except Exception as error:
                self.send(REJECTED, RequestRejected(message.request_id, type(error).__name__,
                                                    str(error)))
        elif kind == ABORT:
            self.core.abort_requests(message)
        elif kind == UTILITY:
            try:
                result = call_utility(self.core, message.method, message.args)
                reply = UtilityResult(message.call_id, result)
            except Exception as error:
                reply = UtilityResult(message.call_id, error=str(error),
                                      exc_type=type(error).__name__,
                                      traceback=traceback.format_exc())
            self.send(UTILITY_RESULT, reply)
        elif kind in (SHUTDOWN, _PARENT_GONE):
            self.stopping = True
        elif kind == _EXECUTOR_FAILED:
            raise EngineDeadError(message)
        elif kind == _BAD_INPUT:
            raise RuntimeError(f"undecodable message from the client:\n{message}")
        else:
            raise RuntimeError(f"unknown message type {kind!r}")

    def send_dead(self, reason: str) -> None:
        try:
            self.send(DEAD, CoreDead(reason))
        except Exception:  # the client is gone: nobody to tell
            pass

    def close(self) -> None:
        """Close the sockets; what was sent is delivered within OUTPUT_FLUSH_S if the client
        is there to take it."""
        self.output_socket.close()  # lingers up to OUTPUT_FLUSH_S
        self.ctx.term()  # the input thread's recv raises ContextTerminated and closes its socket


def _raise_system_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def start_core(config, input_addr: str, output_addr: str, input_queue: queue.Queue,
               executor_class: type | None = None) -> tuple["EngineCore", EngineCoreProc]:
    """The engine core and its loop's sockets, connected to the client's addresses."""
    from mrv2.core.engine_core import EngineCore

    core = EngineCore(config, executor_class)
    try:
        return core, EngineCoreProc(core, input_queue, input_addr, output_addr)
    except BaseException:
        core.shutdown()
        raise


def serve_core(core: "EngineCore", proc: EngineCoreProc) -> int:
    """Run the busy loop until SHUTDOWN, the parent's loss or a failure (sent to the client as
    DEAD first); then shut the core and the sockets. The exit code."""
    exit_code = 0
    try:
        proc.run_busy_loop()
    except SystemExit as stop:
        exit_code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        exit_code = 1
        text = traceback.format_exc()
        print(f"mrv2 engine core failed:\n{text}", file=sys.stderr)
        proc.send_dead(f"the engine core failed:\n{text}")
    finally:
        try:
            core.shutdown()
        finally:
            proc.close()
    return exit_code


def run_engine_core(config, input_addr: str, output_addr: str, ready_conn: "Connection",
                    death_conn: "Connection", executor_class: type | None = None) -> None:
    """Entry point of the engine-core process (spawn context)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, _raise_system_exit)  # terminate(): unwind, shut the executor
    input_queue: queue.Queue = queue.Queue()
    watch_parent(death_conn, lambda: input_queue.put((_PARENT_GONE, None)),
                 PARENT_GONE_GRACE_S, name="mrv2-core-death-pipe")
    try:
        from executor.heap import freeze_startup_objects

        core, proc = start_core(config, input_addr, output_addr, input_queue, executor_class)
        report_ready(ready_conn, CoreReady(os.getpid(),
                                           num_kv_blocks=core.executor.num_kv_blocks))
        freeze_startup_objects()  # this process holds one engine for its life (executor/heap.py)
    except BaseException as error:
        text = traceback.format_exc()
        report_ready(ready_conn, CoreReady(os.getpid(), error=text,
                                           exc_type=type(error).__name__), text)
        sys.exit(1)
    finally:
        ready_conn.close()
    exit_code = serve_core(core, proc)
    # Everything this process owns is released; skip the interpreter's teardown (about a
    # second of library finalizers) so that shutdown is quick.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class CoreProcess:
    """The parent's handle on an engine-core process: spawn, start-up handshake, stop.

    The parent holds the only write end of the core's death pipe; `stop()` closes it, so the
    core exits even if it never reads a SHUTDOWN message, then escalates to SIGTERM, SIGKILL.
    """

    def __init__(self, config, input_addr: str, output_addr: str,
                 executor_class: type | None = None) -> None:
        self._ready_conn, ready_w = pipe()
        death_r, self._death_w = pipe()
        self.proc = spawn(run_engine_core, (config, input_addr, output_addr, ready_w, death_r,
                                            executor_class),
                          name="mrv2-engine-core", child_ends=(ready_w, death_r),
                          env=free_cores.pool_env(
                              config.parallel_config.data_parallel_size))

    def wait_ready(self, timeout: float) -> CoreReady:
        """The core's CoreReady; raises WorkerStartupError (with the core's traceback text)
        if it failed, exited or did not answer within `timeout` seconds."""
        name = "the engine core process"
        return wait_ready([self.proc], [self._ready_conn], CoreReady, timeout, names=[name],
                          timeout_message=lambda _: f"{name} (pid {self.proc.pid})",
                          join_s=2.0)[0]

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def watch(self, wake: "Connection", on_exit: Callable[[], None]) -> threading.Thread:
        """A thread that calls `on_exit()` when the process exits, unless `wake` closes
        first."""
        return watch_processes([self.proc], wake, lambda _: on_exit(), name="mrv2-core-monitor")

    def exit_text(self) -> str:
        self.proc.join(0.1)
        return (f"the engine core process (pid {self.proc.pid}) died unexpectedly (exit code "
                f"{self.proc.exitcode})")

    def stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the process to leave; then terminate, then kill it."""
        self._death_w.close()
        stop_processes([self.proc], grace_s, join_s=2.0)
