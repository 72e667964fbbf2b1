"""Process helpers shared by the engine-core client (mrv2/engine/client.py, core_proc.py) and
the multiprocess executor (executor/multiproc.py, worker_proc.py).

Parent side:
- `pipe()` / `spawn()`: spawn-context pipes and processes; the pipe ends handed to the child
  are closed in the parent once it started; the child may start with extra variables.
- `wait_ready()`: the start-up handshake. Each child sends one msgpack message over its ready
  pipe (a struct with an `error` field: None, or the start-up traceback text); a child that
  reports an error, exits or stays silent past the timeout raises `WorkerStartupError`.
- `watch_processes()`: a monitor thread that waits on the children's sentinels and a wake-up
  pipe (its write end is closed on shutdown) and reports the first child that exited.
- `stop_processes()`: join within a grace period, then SIGTERM, then SIGKILL.
- `distributed_init_method()`: a free `tcp://host:port` where the children's process group
  meets (torch.distributed rendezvous).
- `settle()`: complete a future once (concurrent or asyncio); later attempts are ignored, so a
  monitor failing a future and a reader completing it cannot both win.

Child side:
- `watch_parent()`: the death pipe. The parent holds the only write end, so EOF on the read end
  means the parent is gone: `on_gone()` is called and the process exits after a grace period
  regardless.
- `report_ready()`: send the start-up message (printing the traceback where the pipe is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
from concurrent.futures import InvalidStateError
from typing import Any, Callable, Sequence

import msgspec

from executor.errors import WorkerStartupError

SPAWN = mp.get_context("spawn")
# Why a spawned child dies before its first line, as a rule: it re-runs the parent's main
# script, which starts the engine again at import time.
SPAWN_HINT = ("Worker processes are spawned and re-import the main script: if it creates the "
              "engine at import time, put that code under `if __name__ == \"__main__\":` (as "
              "with vLLM); its traceback is above, on standard error.")


def pipe() -> tuple[multiprocessing.connection.Connection, multiprocessing.connection.Connection]:
    """A one-way pipe: (read end, write end)."""
    return SPAWN.Pipe(duplex=False)


def spawn(target: Callable, args: tuple, *, name: str, daemon: bool = False,
          child_ends: Sequence[multiprocessing.connection.Connection] = (),
          env: dict[str, str] | None = None) -> mp.process.BaseProcess:
    """Start `target(*args)` in a spawned process; close `child_ends` here once it started.
    `env`: variables the child starts with on top of this process's (read by libraries as
    they load, before any of the child's code runs: thread pools' sizes)."""
    proc = SPAWN.Process(target=target, name=name, daemon=daemon, args=args)
    try:
        with _main_importable_by_children(), _child_environment(env or {}):
            proc.start()
    finally:
        for conn in child_ends:
            conn.close()
    return proc


_MAIN_LOCK = threading.Lock()
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _child_environment(env: dict[str, str]):
    """This process's environment with `env` on top while a child starts (a spawned child
    copies it then), restored after."""
    if not env:
        yield
        return
    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@contextlib.contextmanager
def _main_importable_by_children():
    """A spawned child re-runs the parent's main script by its `__file__`, to find functions
    defined there. A main read from standard input (`python - < x.py`, `__file__` "<stdin>")
    has no file to re-run, and the child would die before its first line. Our targets live in
    modules, so the child does not need that main: for the start, `__file__` is hidden.
    Interactive sessions and notebooks have no `__file__`, so they need nothing."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(main, "__spec__", None) is not None \
            or os.path.isfile(path):
        yield
        return
    with _MAIN_LOCK:
        del main.__file__
        try:
            yield
        finally:
            main.__file__ = path


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at the moment of the call (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def distributed_init_method(host: str = "127.0.0.1", port: int | None = None) -> str:
    """A `tcp://host:port` rendezvous address for `torch.distributed.init_process_group`."""
    return f"tcp://{host}:{get_open_port(host) if port is None else port}"


def settle(future: Any, result: Any = None, error: BaseException | None = None) -> None:
    """Complete `future` with `result` or `error` unless it is already done."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except (InvalidStateError, asyncio.InvalidStateError):  # already settled
        pass


def wait_ready(procs: Sequence[mp.process.BaseProcess], conns: Sequence, ready_type: type,
               timeout: float, *, names: Sequence[str],
               timeout_message: Callable[[list[int]], str], with_rank: bool = False,
               join_s: float = 1.0, on_ready: Callable[[int, Any], None] | None = None
               ) -> list[Any]:
    """Every child's ready message, in order; raises `WorkerStartupError` when one reports an
    error, exits first, or the `timeout` passes. `names[i]` names child i in messages; the ready
    pipes are closed on return."""
    readies: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(readies) < len(procs):
            waiting = [i for i in range(len(procs)) if i not in readies]
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartupError(f"{timeout_message(waiting)} did not report ready "
                                         f"within {timeout:.0f} s")
            mp.connection.wait([conns[i] for i in waiting]
                               + [procs[i].sentinel for i in waiting], timeout=left)
            for i in waiting:
                proc, rank = procs[i], (i if with_rank else None)
                if conns[i].poll():
                    try:
                        ready = msgspec.msgpack.decode(conns[i].recv_bytes(), type=ready_type)
                    except EOFError:
                        ready = None
                    if ready is not None and ready.error is None:
                        readies[i] = ready
                        if on_ready is not None:
                            on_ready(i, ready)
                        continue
                    proc.join(join_s)
                    if ready is not None:
                        raise WorkerStartupError(
                            f"{names[i]} (pid {proc.pid}) failed to start:\n{ready.error}",
                            rank=rank, exc_type=getattr(ready, "exc_type", ""),
                            remote_traceback=ready.error)
                if not proc.is_alive():
                    raise WorkerStartupError(
                        f"{names[i]} (pid {proc.pid}) exited with code {proc.exitcode} before "
                        f"it reported ready. {SPAWN_HINT}", rank=rank)
    finally:
        for conn in conns:
            conn.close()
    return [readies[i] for i in range(len(procs))]


def watch_processes(procs: Sequence[mp.process.BaseProcess],
                    wake: multiprocessing.connection.Connection,
                    on_exit: Callable[[int], None], *, name: str) -> threading.Thread:
    """Start a daemon thread that waits until a child exits or `wake` is readable (its write
    end closed); then calls `on_exit(i)` for the lowest-numbered child that exited, if any."""

    def watch() -> None:
        sentinels = {proc.sentinel: i for i, proc in enumerate(procs)}
        fired = mp.connection.wait([*sentinels, wake])
        exited = [sentinels[s] for s in fired if s in sentinels]
        if exited:
            on_exit(min(exited))

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def stop_processes(procs: Sequence[mp.process.BaseProcess], grace_s: float,
                   join_s: float = 1.0) -> None:
    """Wait up to `grace_s` (in all) for the children to leave; then terminate, then kill the
    ones still alive, waiting up to `join_s` after each signal."""
    procs = [proc for proc in procs if proc.pid is not None]  # never started: nothing to stop
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(join_s)
        if proc.is_alive():
            proc.kill()
            proc.join(join_s)


# -- child side ----------------------------------------------------------------------------------


def watch_parent(death_conn: multiprocessing.connection.Connection, on_gone: Callable[[], None],
                 grace_s: float, *, name: str) -> threading.Thread:
    """Start a daemon thread that returns from the death pipe only at EOF (the parent never
    sends): then `on_gone()`, and after `grace_s` the process exits regardless."""

    def watch() -> None:
        try:
            death_conn.recv()
        except (EOFError, OSError):
            pass
        on_gone()
        time.sleep(grace_s)  # let the loop exit cleanly; then go regardless
        os._exit(1)

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def report_ready(conn: multiprocessing.connection.Connection, message: Any,
                 error_text: str | None = None) -> None:
    """Send the start-up message. With `error_text` (a failed start-up) a broken pipe is not an
    error: the text is printed to stderr instead."""
    if error_text is None:
        conn.send_bytes(msgspec.msgpack.encode(message))
        return
    try:
        conn.send_bytes(msgspec.msgpack.encode(message))
    except Exception:
        print(error_text, file=sys.stderr)
