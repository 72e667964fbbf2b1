"""Data parallelism under `mrv2 bench serve`: request throughput of `mrv2 serve -dp 2` against
`-dp 1` on the W1 model (bench/e2e_workload.py), alternating in one run, medians per setting.

Each round starts the server (127.0.0.1, a free port), runs `mrv2 bench serve` against it
(random prompts, all at once up to `--max-concurrency`), and stops it. The JSON holds every
round's metrics and, per setting, the median request and output-token throughput and the
ratio dp2 / dp1. Measures one machine: the cores share its CPUs (on 2 vCPUs two engine cores
split the two).

    PYTHONPATH=bench:. .venv/bin/python bench/dp_serve_ab.py --rounds 3 --output x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from e2e_workload import W1, model_dir
from mrv2.testing.server import ServerProcess


def one_round(model: Path, dp: int, args: argparse.Namespace) -> dict:
    with ServerProcess(model, ["--data-parallel-size", str(dp), "--max-model-len", "512",
                               "--max-num-seqs", str(args.max_concurrency)]) as server:
        out = Path(tempfile.mkdtemp()) / "bench.json"
        subprocess.run([sys.executable, "-m", "mrv2.entrypoints.cli", "bench", "serve",
                        "--base-url", server.url, "--num-prompts", str(args.num_prompts),
                        "--max-concurrency", str(args.max_concurrency),
                        "--random-input-len", str(args.input_len),
                        "--random-output-len", str(args.output_len),
                        "--vocab-size", "16000", "--output-json", str(out)],
                       check=True, timeout=1800)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    model = model_dir(W1)
    rounds: list[dict] = []
    for _ in range(args.rounds):
        for dp in (1, 2):  # alternating: drift in the machine's speed hits both alike
            metrics = one_round(model, dp, args)
            rounds.append({"dp": dp, **metrics})
            print(f"dp={dp}: {metrics['request_throughput']:.2f} req/s, "
                  f"{metrics['output_throughput']:.1f} tok/s", flush=True)
    summary = {}
    for dp in (1, 2):
        mine = [r for r in rounds if r["dp"] == dp]
        summary[f"dp{dp}"] = {key: statistics.median(r[key] for r in mine)
                              for key in ("request_throughput", "output_throughput")}
    summary["dp2_over_dp1"] = (summary["dp2"]["request_throughput"]
                               / summary["dp1"]["request_throughput"])
    args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                       "summary": summary, "rounds": rounds}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
