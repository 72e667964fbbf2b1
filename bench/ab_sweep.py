"""Two builds or two modes of mrv2 measured alternately in one run: `mrv2 bench sweep` (its
engine wrappers, prompts, metric) in child interpreters, A then B each round, so machine drift
falls on both; per cell (engine, batch) the median over rounds of each side's median and the
B / A ratio (decode tok/s, and first-token seconds: there B / A < 1 is B faster).

A side is a source tree (`--a-src`, `--b-src`: a checkout put first on PYTHONPATH; default this
repository) and environment settings (`--a-env`, `--b-env`: NAME=VALUE, repeatable). Two uses:

    # the cost of batch-invariant mode against the default, same build
    python bench/ab_sweep.py --b-env MRV2_BATCH_INVARIANT=1 --out invariant.json -- \
        --engines mrv2:float32,mrv2:gguf,mrv2:bf16 --batch-sizes 1,32
    # int8 prefill (the default where it runs) against the bfloat16 copies alone
    python bench/ab_sweep.py --b-env MRV2_GGUF_PREFILL=bf16 --out int8.json -- \
        --engines mrv2:default --batch-sizes 1,32 --output-len 2
    # a change against the commit before it (a clean checkout of it in /tmp/base)
    python bench/ab_sweep.py --a-src /tmp/base --out change.json -- --batch-sizes 1,8,32

Arguments after `--` go to every sweep (default --repeats 1 within a sweep: the rounds repeat).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def sweep(src: Path, env: dict[str, str], sweep_args: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ab-sweep-") as tmp:
        out = Path(tmp) / "sweep.json"
        child_env = {**os.environ, **env, "PYTHONPATH": str(src)}
        cmd = [sys.executable, "-m", "mrv2.entrypoints.cli", "bench", "sweep",
               "--format", "text", "--output-json", str(out), *sweep_args]
        subprocess.run(cmd, check=True, cwd=src, env=child_env, stdout=sys.stderr)
        return json.loads(out.read_text())


def cells(result: dict[str, Any]) -> dict[str, float]:
    """Per (engine, batch): decode tok/s, and first-token seconds ("... first token s")."""
    out = {}
    for m in result["measurements"]:
        if m.get("decode_tok_s_median"):
            out[f"{m['column']} b{m['batch']}"] = m["decode_tok_s_median"]
        if m.get("first_token_s_median"):
            out[f"{m['column']} b{m['batch']} first token s"] = m["first_token_s_median"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a-src", type=Path, default=REPO)
    parser.add_argument("--b-src", type=Path, default=REPO)
    parser.add_argument("--a-env", action="append", default=[])
    parser.add_argument("--b-env", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args, sweep_args = parser.parse_known_args()
    sweep_args = [a for a in sweep_args if a != "--"]
    if "--repeats" not in sweep_args:
        sweep_args += ["--repeats", "1"]
    sides = {"A": (args.a_src, dict(e.split("=", 1) for e in args.a_env)),
             "B": (args.b_src, dict(e.split("=", 1) for e in args.b_env))}
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    loads = []
    for _ in range(args.rounds):
        for side, (src, env) in sides.items():
            loads.append(os.getloadavg()[0])
            runs[side].append(cells(sweep(src, env, sweep_args)))
    table = {}
    for cell in runs["A"][0]:
        a = statistics.median(r[cell] for r in runs["A"] if cell in r)
        b = statistics.median(r[cell] for r in runs["B"] if cell in r)
        table[cell] = {"A": a, "B": b, "ratio": b / a}
        digits = 3 if cell.endswith(" s") else 1
        print(f"{cell:32s} A {a:8.{digits}f}  B {b:8.{digits}f}  B/A {b / a:.3f}")
    print(f"1-minute load before each sweep: {', '.join(f'{x:.2f}' for x in loads)}")
    Path(args.out).write_text(json.dumps({"sides": {k: {"src": str(v[0]), "env": v[1]}
                                                    for k, v in sides.items()},
                                          "sweep_args": sweep_args, "cells": table,
                                          "runs": runs, "loadavg": loads}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
