"""A real `mrv2 serve` process on 127.0.0.1 (a free port), shared by the server tests.

The server is started as a user would start it (`python -m mrv2.entrypoints.cli serve ...`);
its engine core is a process of its own. One server serves the whole session (startup is
most of the cost); tests that break a server (killing its core) start their own.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512
SERVER_ARGS = ["--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", "32", "--api-key", API_KEY, "--uvicorn-log-level", "warning"]
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    def __init__(self, model: Path | str, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mrv2-serve-", suffix=".log",
                                               delete=False)
        # A private TMPDIR: the engine core's socket directory lands there, so a test can
        # check that stopping the server removed it.
        self.tmpdir = tempfile.mkdtemp(prefix="mrv2-serve-tmp-")
        self.leftovers: list[str] = []
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TMPDIR=self.tmpdir)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mrv2.entrypoints.cli", "serve", str(model),
             "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n"
                                   f"{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not start in {STARTUP_TIMEOUT_S} s:\n"
                           f"{self.log_text()}")

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", API_KEY)
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kwargs)

    def async_client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", API_KEY)
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60,
                                  **kwargs)

    def metrics(self) -> dict[str, float]:
        """Sample name (labels dropped; one model) -> value, parsed with prometheus_client."""
        from prometheus_client.parser import text_string_to_metric_families

        response = httpx.get(f"{self.url}/metrics", timeout=10)
        assert response.status_code == 200
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if set(sample.labels) <= {"model_name"}:
                    values[sample.name] = sample.value
        return values

    def core_pid(self) -> int:
        """The engine-core process: the server's spawned child (not the resource tracker)."""
        for child in _children(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                return child
        raise RuntimeError("no engine-core process found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)
        self.leftovers = sorted(os.listdir(self.tmpdir))
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


@pytest.fixture(scope="session")
def server(tiny_llama):
    remote = RemoteServer(tiny_llama, SERVER_ARGS)
    yield remote
    remote.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()
