"""ServerProcess: a server that cannot start raises with its log and leaves nothing; stop() is
idempotent; free_port gives a bindable port."""

from __future__ import annotations

import os
import socket

import pytest

from mrv2.testing import ServerProcess, free_port


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_server_that_cannot_start_raises_with_its_log_and_leaves_nothing(tmp_path):
    server = ServerProcess(tmp_path / "no-such-model", [], wait=False, startup_timeout_s=60)
    with pytest.raises(RuntimeError, match="exited") as info:
        server.wait_ready()
    assert "no-such-model" in str(info.value)  # the server's own error, from its log
    assert server.proc.poll() is not None
    assert not os.path.exists(server.log.name) and not os.path.isdir(server.tmpdir)
    server.stop()  # a second stop is a no-op
