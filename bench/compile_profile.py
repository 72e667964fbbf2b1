"""Where the suite's time goes to numba: a pytest plugin that records every compile.

The suite (scripts/test.sh) runs from a clean clone with an empty numba cache, so much of its
20-minute budget is numba compiling the kernels (bench/README.md, "The suite's compile time").
This plugin times each top-level compile (a kernel's callees compile inside it and count
towards it) and attributes it to the running test and to the compiled function, and records
when each test started and ended on its xdist worker (so an idle worker at the end shows).

    MRV2_CACHE_DIR=$(mktemp -d) PYTHONPATH=bench .venv/bin/python -m pytest \\
        -p compile_profile tests bench -q --benchmark-disable -n 2 --dist loadfile
    .venv/bin/python bench/compile_profile.py      # the summary

Each worker writes its JSON to $MRV2_COMPILE_PROFILE_DIR (default /tmp/mrv2-compile-profile).
Compiles in processes a test starts (engine cores, servers) are not seen.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest
from numba.core import event

OUT_DIR = Path(os.environ.get("MRV2_COMPILE_PROFILE_DIR", "/tmp/mrv2-compile-profile"))


class _CompileTimes(event.Listener):
    """Inclusive seconds of each outermost compile, by test and by function."""

    def __init__(self) -> None:
        self.test = "<collection>"
        self.depth, self.started, self.function = 0, 0.0, ""
        self.by_test: dict[str, float] = collections.defaultdict(float)
        self.by_function: dict[str, float] = collections.defaultdict(float)
        self.count: dict[str, int] = collections.Counter()

    def on_start(self, ev: event.Event) -> None:
        if self.depth == 0:
            func = getattr(ev.data["dispatcher"], "py_func", ev.data["dispatcher"])
            self.started = time.perf_counter()
            self.function = f"{func.__module__}.{func.__qualname__}"
        self.depth += 1

    def on_end(self, ev: event.Event) -> None:
        self.depth -= 1
        if self.depth == 0:
            seconds = time.perf_counter() - self.started
            self.by_test[self.test] += seconds
            self.by_function[self.function] += seconds
            self.count[self.function] += 1


_times = _CompileTimes()
_timeline: list[list] = []  # [test id, start, end] in wall-clock seconds
event.register("numba:compile", _times)


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _times.test = nodeid
    _timeline.append([nodeid, time.time(), None])


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    if _timeline and _timeline[-1][0] == nodeid:
        _timeline[-1][2] = time.time()


def pytest_unconfigure(config: pytest.Config) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (OUT_DIR / f"{worker}.json").write_text(json.dumps({
        "by_test": _times.by_test, "by_function": _times.by_function,
        "count": _times.count, "timeline": _timeline}))


def summary(out_dir: Path = OUT_DIR, top: int = 15) -> str:
    """The workers' compile seconds in all, by function and by test file, and when each
    worker ran its last test."""
    by_function, count = collections.Counter(), collections.Counter()
    by_file = collections.Counter()
    lines, total = [], 0.0
    for path in sorted(out_dir.glob("gw*.json")):
        data = json.loads(path.read_text())
        by_function.update(data["by_function"])
        count.update(data["count"])
        for test, seconds in data["by_test"].items():
            by_file[test.split("::")[0]] += seconds
        total += sum(data["by_function"].values())
        spans = [(start, end or start) for _, start, end in data["timeline"]]
        if spans:
            ran = max(end for _, end in spans) - min(start for start, _ in spans)
            lines.append(f"{path.stem}: tests ran {ran:.0f} s")
    lines.append(f"compile, all workers: {total:.0f} s")
    lines += [f"{s:7.1f} s {count[f]:3d}x {f}" for f, s in by_function.most_common(top)]
    lines += [f"{s:7.1f} s {f}" for f, s in by_file.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR))
