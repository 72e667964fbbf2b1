"""DPAsyncClient: `data_parallel_size` engine cores behind one front end (vLLM's data
parallelism with its internal load balancer), with AsyncMPClient's interface, for AsyncLLM.

Each engine core is its own process with the whole model (and, under tensor or pipeline
parallelism, its own workers), or with `data_parallel_backend="ray"` a Ray actor placed on the
cluster (mrv2/engine/ray_core.py); requests are spread over them:
- **Routing.** A new request goes to the core with the fewest unfinished requests this client
  sent it (its running plus waiting queues, as the client knows them exactly: a request counts
  from its add until its finishing output, rejection or abort), ties to the lower KV cache
  usage of the cores' last stats, then to the lower index.
- **Outputs.** One reader task per core puts its outputs into one queue, which
  `get_output_async` takes in arrival order. A request's outputs all come from its core.
- **Aborts** go to the core that holds the request.
- **Utilities** (sleep, wake_up, reset_prefix_cache, ...) run on every core; their answer is
  the cores' common answer, or, for yes/no answers, whether every core said yes.
- **Stats.** `get_stats_async` sums the cores' (the KV usage weighted by their blocks);
  `get_engine_stats_async` gives each core's, for `/metrics` (labelled by engine index).
- **Failure.** One core's death fails the whole client, as in vLLM: every waiter and later
  call gets EngineDeadError naming that core.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from mrv2.config import EngineConfig
from mrv2.engine.async_client import AsyncMPClient
from mrv2.engine.client import DEFAULT_STARTUP_TIMEOUT_S, RequestRejectedError
from mrv2.errors import EngineDeadError
from mrv2.protocol import CoreStats, EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from mrv2.engine.ray_core import RayCorePlacement


class DPAsyncClient:
    def __init__(self, config: EngineConfig, *, executor_class: type | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        size = config.parallel_config.data_parallel_size
        self.clients: list[AsyncMPClient] = []
        self.placement: RayCorePlacement | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers: list[asyncio.Task] = []
        try:
            if config.parallel_config.data_parallel_backend == "ray":
                from mrv2.engine.ray_core import RayCorePlacement

                self.placement = RayCorePlacement(config)
            for index in range(size):
                self.clients.append(AsyncMPClient(
                    config, executor_class=executor_class, startup_timeout_s=startup_timeout_s,
                    core_launcher=None if self.placement is None
                    else self.placement.launcher(index)))
        except BaseException:
            self.shutdown()
            raise
        self._owner: dict[str, int] = {}  # request id -> the core that holds it
        self._load = [0] * size  # unfinished requests sent to each core
        self._kv_usage = [0.0] * size  # from the cores' last stats
        self._merged: asyncio.Queue | None = None

    # -- state -------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return any(client.is_dead for client in self.clients)

    @property
    def dead_reason(self) -> str | None:
        for index, client in enumerate(self.clients):
            if client.dead_reason is not None:
                return f"data-parallel engine {index}: {client.dead_reason}"
        return None

    def _check_alive(self) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)

    def route(self) -> int:
        """The core the next request goes to."""
        return min(range(len(self.clients)),
                   key=lambda i: (self._load[i], self._kv_usage[i], i))

    def _release(self, request_id: str) -> None:
        index = self._owner.pop(request_id, None)
        if index is not None:
            self._load[index] -= 1

    # -- requests ----------------------------------------------------------------------------

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        index = self.route()
        self._owner[request.request_id] = index
        self._load[index] += 1
        try:
            await self.clients[index].add_request_async(request)
        except BaseException:
            self._release(request.request_id)
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._owner.get(request_id)
            if index is not None:
                by_core.setdefault(index, []).append(request_id)
                self._release(request_id)
        for index, ids in by_core.items():
            await self.clients[index].abort_requests_async(ids)

    # -- outputs -----------------------------------------------------------------------------

    def _ensure_readers(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and all(not task.done() for task in self._readers):
            return
        for task in self._readers:
            task.cancel()
        self._loop, self._merged = loop, asyncio.Queue()
        self._readers = [loop.create_task(self._read(client), name=f"mrv2-dp-output-{i}")
                         for i, client in enumerate(self.clients)]

    async def _read(self, client: AsyncMPClient) -> None:
        while True:
            try:
                item: Any = await client.get_output_async()
            except RequestRejectedError as error:
                item = error
            except asyncio.CancelledError:
                raise
            except BaseException as error:  # the core died: the client fails as a whole
                self._merged.put_nowait(EngineDeadError(self.dead_reason or str(error)))
                return
            self._merged.put_nowait(item)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._check_alive()
        self._ensure_readers()
        item = await self._merged.get()
        if isinstance(item, EngineDeadError):
            self._merged.put_nowait(item)  # for the next waiter
            raise item
        if isinstance(item, RequestRejectedError):
            self._release(item.request_id)
            raise item
        for output in item.outputs:
            if output.finished:
                self._release(output.request_id)
        return item

    # -- utilities ---------------------------------------------------------------------------

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._check_alive()
        results = await asyncio.gather(*(client.call_utility_async(method, *args)
                                         for client in self.clients))
        if all(isinstance(r, bool) for r in results):
            return all(results)
        return results[0] if all(r == results[0] for r in results) else results

    async def get_engine_stats_async(self) -> list[CoreStats]:
        self._check_alive()
        stats = list(await asyncio.gather(*(client.get_stats_async()
                                            for client in self.clients)))
        self._kv_usage = [s.kv_cache_usage for s in stats]
        return stats

    async def get_stats_async(self) -> CoreStats:
        return merged_stats(await self.get_engine_stats_async())

    def shutdown(self) -> None:
        for task in self._readers:
            if not task.done() and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(task.cancel)
        for client in self.clients:
            client.shutdown()
        if self.placement is not None:
            self.placement.close()


def merged_stats(stats: list[CoreStats]) -> CoreStats:
    """The cores' stats as one core's: counts summed, the KV usage weighted by the blocks."""
    blocks = sum(s.num_kv_blocks for s in stats)
    spec = [sum(column) for column in zip(*(s.spec_decode for s in stats))] \
        if all(s.spec_decode for s in stats) else []
    return CoreStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        num_unfinished=sum(s.num_unfinished for s in stats),
        has_unfinished=any(s.has_unfinished for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage * s.num_kv_blocks for s in stats) / max(blocks, 1),
        num_free_blocks=sum(s.num_free_blocks for s in stats), num_kv_blocks=blocks,
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats), spec_decode=spec)
