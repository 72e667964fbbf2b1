"""A real `mrv2 serve` process on 127.0.0.1 (a free port), for the server tests and benchmarks.

The server is started as a user would start it (`python -m mrv2.entrypoints.cli serve ...`);
its engine core is a process of its own. `stop()` sends SIGTERM, as a service manager would,
and records what the server left in its private TMPDIR (`leftovers`: empty when the engine
core removed its socket directory).
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

STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`mrv2 serve MODEL --port <free> ARGS...`; returns once `/health` answers 200 (with
    `wait=False` at once: call `wait_ready()` before using it, and do other work meanwhile). A
    context manager: leaving the block stops the server."""

    def __init__(self, model: Path | str, args: list[str], *, wait: bool = True,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mrv2-serve-", suffix=".log",
                                               delete=False)
        # A private TMPDIR: the engine core's socket directory lands there, so a caller can
        # check that stopping the server removed it.
        self.tmpdir = tempfile.mkdtemp(prefix="mrv2-serve-tmp-")
        self.leftovers: list[str] = []
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TMPDIR=self.tmpdir)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mrv2.entrypoints.cli", "serve", str(model),
             "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_ready()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        """Returns once `/health` answers 200; if the server exits or does not answer within
        `startup_timeout_s` (from now), stops it and raises with its log."""
        import httpx  # a dev dependency: only tests and benchmarks start servers

        try:
            deadline = time.monotonic() + self.startup_timeout_s
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
            raise TimeoutError(f"the server did not start in {self.startup_timeout_s} s:\n"
                               f"{self.log_text()}")
        except BaseException:
            self.stop()
            raise

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

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
        """SIGTERM (SIGKILL after 20 s), then remove the log and the TMPDIR. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)
        if os.path.isdir(self.tmpdir):
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
