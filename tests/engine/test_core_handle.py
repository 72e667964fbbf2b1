"""core_handle: the client's sockets bound for a core on this machine (ipc) or elsewhere (TCP
on the given host), and both kinds of core handle offering what the client calls."""

from __future__ import annotations

import zmq

from mrv2.core.core_proc import CoreProcess
from mrv2.engine.core_handle import CoreHandle, bind_core_socket
from mrv2.engine.ray_core import RayCoreHandle


def test_ipc_without_a_host_and_a_free_tcp_port_with_one(tmp_path):
    ctx = zmq.Context()
    try:
        local, remote = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
        assert bind_core_socket(local, None, f"{tmp_path}/in") == f"ipc://{tmp_path}/in"
        address = bind_core_socket(remote, "127.0.0.1", f"{tmp_path}/unused")
        host, port = address.removeprefix("tcp://").split(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert not (tmp_path / "unused").exists()
        # A core connecting to that address reaches the client's socket.
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        push.send(b"hello")
        assert remote.recv() == b"hello"
        for sock in (local, remote, push):
            sock.close(linger=0)
    finally:
        ctx.term()


def test_both_handles_offer_what_the_client_calls():
    methods = [name for name in vars(CoreHandle) if not name.startswith("_")]
    assert set(methods) == {"wait_ready", "is_alive", "watch", "exit_text", "stop"}
    for handle in (CoreProcess, RayCoreHandle):
        assert all(callable(getattr(handle, name, None)) for name in methods), handle
