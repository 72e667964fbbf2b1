"""The Ray cluster an engine runs on: joined or started, and one placement-group bundle per rank.

- `import_ray()`: Ray is an optional extra; without it the error says how to install it.
- `join_or_start()`: join the running cluster (`RAY_ADDRESS`, or the one `ray start` left on
  this machine), else start a one-node cluster for this process, on 127.0.0.1 only. Returns
  whether this process started it, so that it also stops it. Ray maps 127.0.0.1 to the
  machine's other address unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which it reads when it
  is imported: when no cluster is running and Ray is not imported yet, that variable is set
  first. (Not when joining: a driver that calls itself 127.0.0.1 cannot find its node among a
  real cluster's.)
- `place_ranks()`: a placement group of one bundle per rank, packed onto as few nodes as
  possible (vLLM's default); a group the cluster cannot place within the timeout fails naming
  what it asked for and what the cluster has.
- `carried_env()`: the environment variables an actor gets from the engine's process (Ray
  starts actors from its own raylet's environment, not from the caller's).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

from executor.errors import WorkerStartupError

RAY_INSTALL_HINT = ("distributed_executor_backend='ray' needs Ray, an optional extra: "
                    "pip install 'mrv2[ray]'")
# Prefixes and names of variables that change what a worker computes or how fast.
_CARRIED_PREFIXES = ("MRV2_", "NUMBA_", "TRITON_", "HF_", "TRANSFORMERS_", "TORCH_")
_CARRIED_NAMES = ("OMP_NUM_THREADS", "PYTHONHASHSEED")


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(RAY_INSTALL_HINT) from e
    return ray


def _cluster_running() -> bool:
    """A cluster to join: RAY_ADDRESS, or the address file `ray start` leaves in Ray's temp dir."""
    temp = os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), "ray")
    return bool(os.environ.get("RAY_ADDRESS")) or os.path.exists(
        os.path.join(temp, "ray_current_cluster"))


def join_or_start() -> bool:
    """Connect this process to a Ray cluster; True when it started a local one (its to stop)."""
    if "ray" not in sys.modules and not _cluster_running():
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = import_ray()
    if ray.is_initialized():
        return False
    # Only a cluster announced as `ray start` does (RAY_ADDRESS, or the address file in this
    # temp dir): address="auto" alone also joins any head process it finds running on the
    # machine, such as another program's (a test worker's) private local cluster.
    if _cluster_running():
        try:
            ray.init(address="auto", log_to_driver=True)
            return False
        except ConnectionError:  # a stale address file: start one for this process
            pass
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=True)
    return True


def bundle_for(device_type: str, units: int = 1) -> dict[str, float]:
    """What one rank (or `units` ranks) asks of its node: GPUs on CUDA, CPUs otherwise."""
    return {"GPU" if device_type == "cuda" else "CPU": float(units)}


def place_ranks(world_size: int, device_type: str, timeout_s: float, *, units: int = 1,
                what: str = "worker rank(s)") -> Any:
    """A ready placement group of `world_size` bundles (of `units` devices each); on timeout
    the group is removed and `WorkerStartupError` names the request and the cluster's free
    resources."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [bundle_for(device_type, units) for _ in range(world_size)]
    group = placement_group(bundles, strategy="PACK", name=f"mrv2-{os.getpid()}-{time.time_ns()}")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise WorkerStartupError(
            f"the Ray cluster could not place the {world_size} {what} within "
            f"{timeout_s:.0f} s: they asked for a placement group of bundles {bundles} "
            f"(strategy PACK); the cluster has {ray.available_resources()} free of "
            f"{ray.cluster_resources()}") from None
    return group


def bundle_nodes(group: Any) -> tuple[list[str], dict[str, int]]:
    """The node id of each bundle of a ready placement group (rank order), and the CPUs of
    every live node of the cluster."""
    ray = import_ray()
    from ray.util.placement_group import placement_group_table

    where = placement_group_table(group)["bundles_to_node_id"]
    cpus = {n["NodeID"]: int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]}
    return [where[i] for i in range(len(where))], cpus


def carried_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(_CARRIED_PREFIXES) or k in _CARRIED_NAMES}
