"""Data-parallel engine cores as Ray actors (`data_parallel_backend="ray"`, vLLM's
`--data-parallel-backend ray`): each core placed on a node of a Ray cluster, talking to its
client over the same ZMQ messages as a core process (mrv2/core/core_proc.py), over TCP.

- `RayCorePlacement`: joins the running cluster or starts a local one (executor/ray_cluster.py,
  127.0.0.1 only), and places one bundle per core (`tensor_parallel_size x
  pipeline_parallel_size` CPUs, or GPUs on CUDA: the core's ranks run on its node, as processes
  of the "mp" executor); `launcher(i)` starts core i in bundle i. `close()` removes the group
  and stops a cluster it started.
- `RayEngineCoreActor`: `start()` builds the core and connects to the client's sockets (its
  CoreReady, or the traceback); `serve()` is the core's busy loop, whose Ray object ref ends
  when the core leaves it or the actor dies: how the client's monitor learns of a death.
- `RayCoreHandle`: the client's side (core_handle.CoreHandle). Stopping waits for the loop to
  leave after SHUTDOWN, then kills the actor.

Thread pools: the cores on one node share its cores (free_cores.pool_env per node, as for the
ranks of the Ray executor). Ray ties an actor's life to its owner's: a client process that dies
takes its cores with it.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from executor.errors import WorkerStartupError
from executor.ray_cluster import bundle_nodes, carried_env, import_ray, join_or_start
from mrv2.config import EngineConfig
from mrv2.core.core_proc import serve_core, start_core
from mrv2.protocol import CoreReady
from mrv2.utils import free_cores

# How often the monitor looks at the core's serve() call; with Ray's own notice of a dead actor
# (under a second) this bounds how soon a dead core fails its client.
MONITOR_POLL_S = 0.2
PLACEMENT_TIMEOUT_S = 120.0


class RayEngineCoreActor:
    def __init__(self, sys_path: list[str]) -> None:
        # As a spawned process gets its parent's sys.path (see executor/ray_worker.py).
        sys.path.extend(p for p in sys_path if p not in sys.path)
        self._started: tuple[Any, Any] | None = None

    def start(self, config: EngineConfig, input_addr: str, output_addr: str,
              executor_class: type | None) -> CoreReady:
        # Ray sets OMP_NUM_THREADS to the bundle's CPUs when the environment has none; torch's
        # pool takes numba's size, as in a core process.
        import torch

        torch.set_num_threads(int(os.environ.get("NUMBA_NUM_THREADS")
                                  or len(os.sched_getaffinity(0))))
        try:
            core, proc = start_core(config, input_addr, output_addr, queue.Queue(),
                                    executor_class)
        except BaseException as error:
            return CoreReady(os.getpid(), error=traceback.format_exc(),
                             exc_type=type(error).__name__)
        self._started = core, proc
        return CoreReady(os.getpid(), num_kv_blocks=core.executor.num_kv_blocks)

    def serve(self) -> int:
        if self._started is None:
            raise RuntimeError("serve() before a successful start()")
        return serve_core(*self._started)


class RayCoreHandle:
    """A core started as an actor in bundle `bundle` of `group` (core_handle.CoreHandle)."""

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str,
                 executor_class: type | None, *, group: Any, bundle: int,
                 resources: dict[str, float], env: dict[str, str]) -> None:
        self._ray = ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = f"data-parallel engine core {bundle} (Ray actor)"
        self.actor = ray.remote(RayEngineCoreActor).options(
            name=f"mrv2-engine-core-{bundle}-{os.getpid()}-{id(self):x}",
            num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle),
            runtime_env={"env_vars": env}).remote(list(sys.path))
        self._starting = self.actor.start.remote(config, input_addr, output_addr,
                                                 executor_class)
        self._serving: Any = None
        self.pid: int | None = None

    def wait_ready(self, timeout: float) -> CoreReady:
        ray = self._ray
        try:
            ready: CoreReady = ray.get(self._starting, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerStartupError(f"the {self.name} did not start within {timeout:.0f} s "
                                     f"(is the cluster short of what the core asked for?)"
                                     ) from None
        except ray.exceptions.RayError as e:
            raise WorkerStartupError(f"the {self.name} died while starting: {e}") from None
        if ready.error is not None:
            raise WorkerStartupError(f"the {self.name} failed to start:\n{ready.error}",
                                     remote_traceback=ready.error)
        self.pid = ready.pid
        self.name = f"data-parallel engine core (Ray actor, pid {ready.pid})"
        self._serving = self.actor.serve.remote()
        return ready

    def _served(self, timeout: float) -> bool:
        done, _ = self._ray.wait([self._serving], timeout=timeout)
        return bool(done)

    def is_alive(self) -> bool:
        return self._serving is not None and not self._served(0)

    def watch(self, wake: Any, on_exit: Callable[[], None]) -> threading.Thread:
        def watch() -> None:
            while not wake.poll(0):
                if self._served(MONITOR_POLL_S):
                    on_exit()
                    return

        thread = threading.Thread(target=watch, name="mrv2-ray-core-monitor", daemon=True)
        thread.start()
        return thread

    def exit_text(self) -> str:
        ray = self._ray
        try:
            how = f"left its loop (exit code {ray.get(self._serving, timeout=1.0)})"
        except ray.exceptions.GetTimeoutError:
            how = "stopped answering"
        except ray.exceptions.RayError as e:
            how = f"died ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        return f"the {self.name} {how}"

    def stop(self, grace_s: float) -> None:
        ray = self._ray
        if not ray.is_initialized():
            return
        if self._serving is not None:
            self._served(grace_s)
        ray.kill(self.actor, no_restart=True)


class RayCorePlacement:
    """The cluster and the placement group of `config`'s data-parallel cores."""

    def __init__(self, config: EngineConfig, timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        from executor.ray_cluster import place_ranks

        self._ray = ray = import_ray()
        parallel = config.parallel_config
        self.started_cluster = join_or_start()
        self.resources = {"GPU" if config.device == "cuda" else "CPU":
                          float(parallel.world_size)}
        self.group = place_ranks(parallel.data_parallel_size, config.device, timeout_s,
                                 units=parallel.world_size, what="data-parallel engine core(s)")
        nodes, node_cpus = bundle_nodes(self.group)
        here = ray.get_runtime_context().get_node_id()
        self.bind_host = ray.util.get_node_ip_address()
        # Each core's environment: the engine's variables, and its share of its node's cores
        # among the cores placed there.
        self.envs = [carried_env() | free_cores.pool_env(
            nodes.count(node), None if node == here else node_cpus.get(node) or None)
            for node in nodes]

    def launcher(self, index: int) -> RayCoreLauncher:
        return RayCoreLauncher(self, index)

    def close(self) -> None:
        ray = self._ray
        if self.group is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None
        if self.started_cluster and ray.is_initialized():
            self.started_cluster = False
            ray.shutdown()


@dataclass(frozen=True)
class RayCoreLauncher:
    """Starts data-parallel core `index` in its bundle (core_handle.CoreLauncher)."""

    placement: RayCorePlacement
    index: int

    @property
    def bind_host(self) -> str:
        return self.placement.bind_host

    def __call__(self, config: EngineConfig, input_addr: str, output_addr: str,
                 executor_class: type | None) -> RayCoreHandle:
        placement = self.placement
        return RayCoreHandle(config, input_addr, output_addr, executor_class,
                             group=placement.group, bundle=self.index,
                             resources=placement.resources, env=placement.envs[self.index])
