"""executor/process.py: spawning children from any kind of main script."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SPAWN_ONE = textwrap.dedent("""
    import time
    from executor.process import spawn
    proc = spawn(time.sleep, (0,), name="child")
    proc.join(60)
    print("exit", proc.exitcode)
""")


def run_python(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_spawn_from_a_script_read_on_stdin():
    """`python - < script.py` (main's __file__ is "<stdin>"): the child must not try to re-run
    a file that does not exist."""
    result = run_python(["-"], stdin=SPAWN_ONE)
    assert result.stdout.strip() == "exit 0", result.stderr


def test_unguarded_main_script_gets_the_hint(tmp_path):
    """A script that starts children at import time: each child re-runs it and dies; the
    parent's error says why and what to do."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import msgspec
        from executor.process import pipe, spawn, wait_ready

        class Ready(msgspec.Struct):
            error: str | None = None

        read, write = pipe()
        proc = spawn(write.close, (), name="child", child_ends=[write])
        wait_ready([proc], [read], Ready, 60, names=["child"], join_s=10,
                   timeout_message=lambda waiting: "child")
    """))
    result = run_python([str(script)])
    assert result.returncode != 0
    assert "WorkerStartupError" in result.stderr
    assert 'if __name__ == "__main__":' in result.stderr


SPAWN_WITH_ENV = textwrap.dedent("""
    import os
    from executor.process import spawn
    if __name__ == "__main__":
        os.environ["KEPT"] = "parent"
        proc = spawn(os._exit, (0,), name="child", env={"MRV2_TEST_CHILD_ONLY": "7"})
        proc.join(60)
        # The variable was the child's alone: this process's environment is as it was.
        print("exit", proc.exitcode, os.environ.get("MRV2_TEST_CHILD_ONLY"), os.environ["KEPT"])
""")
CHILD_SEES = textwrap.dedent("""
    import os, sys
    from executor.process import spawn


    def report(path):
        open(path, "w").write(os.environ.get("MRV2_TEST_CHILD_ONLY", "unset"))


    if __name__ == "__main__":
        proc = spawn(report, (sys.argv[1],), name="child", env={"MRV2_TEST_CHILD_ONLY": "7"})
        proc.join(60)
""")


def test_a_child_starts_with_extra_variables_the_parent_does_not_keep(tmp_path):
    result = run_python(["-c", SPAWN_WITH_ENV])
    assert result.stdout.strip() == "exit 0 None parent", result.stderr
    script, seen = tmp_path / "child_sees.py", tmp_path / "seen.txt"
    script.write_text(CHILD_SEES)
    result = subprocess.run([sys.executable, str(script), str(seen)], capture_output=True,
                            text=True, cwd=ROOT, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert seen.read_text() == "7", result.stderr
