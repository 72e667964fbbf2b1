"""Where an engine core runs, as its client sees it: the handle on a started core and the
launcher that starts one elsewhere than as a process of this machine (a Ray actor,
mrv2/engine/ray_core.py), and the sockets the client binds for it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from mrv2.config import EngineConfig
from mrv2.protocol import CoreReady


class CoreHandle(Protocol):
    """The client's side of a started engine core: core_proc.CoreProcess (a process of this
    machine) or ray_core.RayCoreHandle (a Ray actor)."""

    def wait_ready(self, timeout: float) -> CoreReady: ...
    def is_alive(self) -> bool: ...
    def watch(self, wake: Any, on_exit: Callable[[], None]) -> threading.Thread: ...
    def exit_text(self) -> str: ...
    def stop(self, grace_s: float) -> None: ...


class CoreLauncher(Protocol):
    """Starts an engine core elsewhere than as a process of this machine. `bind_host`: the
    address the client's sockets bind (TCP) for the core to reach them."""

    bind_host: str

    def __call__(self, config: EngineConfig, input_addr: str, output_addr: str,
                 executor_class: type | None) -> CoreHandle: ...


def bind_core_socket(sock: zmq.Socket, host: str | None, ipc_path: str) -> str:
    """Bind `sock` at `ipc_path` (no host: the core is on this machine) or at a free TCP port
    of `host`; its address."""
    if host is None:
        sock.bind(f"ipc://{ipc_path}")
        return f"ipc://{ipc_path}"
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"
