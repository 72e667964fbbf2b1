"""`mrv2 serve --distributed-executor-backend ray`: the server's engine core starts a Ray
cluster on 127.0.0.1 for its worker actor; killing that actor mid-generation turns `/health`
to 503 within 5 s and fails the request in flight; stopping the server leaves no process of
that cluster running."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import SERVER_ARGS, RemoteServer

pytest.importorskip("ray")


def _processes_with_tmpdir(tmpdir: str, marker: bytes = b"") -> list[int]:
    """The live processes started with TMPDIR=`tmpdir` (the server's private one: its engine
    core and everything of the Ray cluster that core starts), whose command line holds
    `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"TMPDIR={tmpdir}".encode() in environ.split(b"\0") and marker in cmdline:
            found.append(int(entry.name))
    return found


def test_a_killed_worker_actor_turns_health_503_and_nothing_is_left(tiny_llama):
    server = RemoteServer(tiny_llama, [*SERVER_ARGS, "--distributed-executor-backend", "ray"])
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        [actor] = _processes_with_tmpdir(server.tmpdir, b"RayWorkerActor")
        assert _processes_with_tmpdir(server.tmpdir, b"raylet")  # the core's own cluster
        client = server.client()
        errors: list[BaseException] = []

        def stream() -> None:
            try:
                for _ in client.completions.create(model="tiny", prompt="hello", stream=True,
                                                   max_tokens=400, ignore_eos=True):
                    pass
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(actor, signal.SIGKILL)
        while httpx.get(f"{server.url}/health").status_code != 503:
            assert time.monotonic() - killed < 5, "health did not turn 503 within 5 s"
            time.sleep(0.05)
        thread.join(10)
        assert len(errors) == 1, errors  # the stream ended with an error, not quietly
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert info.value.status_code == 503
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while left := _processes_with_tmpdir(server.tmpdir):
        assert time.monotonic() < deadline, f"still running after the server stopped: {left}"
        time.sleep(0.2)
