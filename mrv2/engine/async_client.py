"""AsyncMPClient: the engine-core process client (mrv2/engine/client.py) over zmq.asyncio, for
an event loop (AsyncLLM). Its reader is a task on the loop that first uses it; outputs,
rejections and failure behave as in `MPClient`.
"""

from __future__ import annotations

import asyncio
import traceback
from typing import Any

import msgspec
import zmq

from mrv2.config import EngineConfig
from mrv2.engine.client import (CLIENT_DEAD, DEFAULT_STARTUP_TIMEOUT_S, SEND_POLL_MS,
                                MPClientBase, utility_value)
from mrv2.core_framing import ABORT, ADD, UTILITY
from mrv2.engine.core_handle import CoreLauncher
from mrv2.protocol import CoreStats, EngineCoreOutputs, EngineCoreRequest, UtilityCall


class AsyncMPClient(MPClientBase):
    """asyncio client of an engine-core process. Use it from one event loop; its reader task
    starts on the loop that first awaits it."""

    def __init__(self, config: EngineConfig, *, executor_class: type | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 core_launcher: CoreLauncher | None = None) -> None:
        super().__init__(config, asyncio_mode=True, executor_class=executor_class,
                         startup_timeout_s=startup_timeout_s, core_launcher=core_launcher)

    def _init_io(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    def _ensure_reader(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._task is None or self._loop is not loop or self._task.done():
            self._loop, self._queue = loop, asyncio.Queue()
            self._task = loop.create_task(self._read_outputs(), name="mrv2-client-output")
        return loop

    async def _read_outputs(self) -> None:
        try:
            while True:
                self._dispatch(await self.output_socket.recv_multipart(copy=False))
        except asyncio.CancelledError:
            raise
        except Exception:
            if not self._closed:
                self._fail(f"the client could not read the engine core's output:\n"
                           f"{traceback.format_exc()}")

    def _put_output(self, item: Any) -> None:
        self._queue.put_nowait(item)

    def _wake_waiters(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # nobody waits; later calls check `_dead` first
        _call_on_loop(loop, self._wake_now)

    def _wake_now(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(CLIENT_DEAD)
        self._fail_utility_calls()

    def _close_io(self) -> None:
        task, loop = self._task, self._loop
        if task is not None and not task.done() and loop is not None and not loop.is_closed():
            _call_on_loop(loop, task.cancel)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()

    async def _send(self, kind: bytes, message: Any) -> None:
        self._check_alive()
        frames = self._encode(kind, message)
        while True:
            try:
                await self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # no connected peer (yet, or any more)
                await self.input_socket.poll(SEND_POLL_MS, zmq.POLLOUT)
                self._check_alive()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._check_alive()
        self._ensure_reader()
        return self._unwrap(await self._queue.get())

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._check_alive()
        loop = self._ensure_reader()
        call_id = next(self._ids)
        future = loop.create_future()
        self._utility[call_id] = future
        try:
            await self._send(UTILITY, UtilityCall(call_id, method, list(args)))
            reply = await future
        finally:
            self._utility.pop(call_id, None)
        return utility_value(method, reply)

    async def get_stats_async(self) -> CoreStats:
        return msgspec.convert(await self.call_utility_async("get_stats"), CoreStats)


def _call_on_loop(loop: asyncio.AbstractEventLoop, function) -> None:
    """Run `function` now when called on `loop`'s thread, else schedule it there (nothing when
    the loop closed meanwhile)."""
    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    if on_loop:
        function()
        return
    try:
        loop.call_soon_threadsafe(function)
    except RuntimeError:  # closed meanwhile
        pass
