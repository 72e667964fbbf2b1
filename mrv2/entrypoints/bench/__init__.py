"""`mrv2 bench throughput` (offline) and `mrv2 bench serve` (online, any OpenAI-compatible
server): vLLM's benchmark commands and output lines; `mrv2 bench sweep`: decode throughput over
batch sizes x precisions x the engines installed (mrv2, transformers, llama.cpp, vLLM)."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: "argparse._SubParsersAction") -> None:
    """Adds `bench throughput`, `bench serve` and `bench sweep` to the top-level subparsers."""
    from mrv2.entrypoints.bench.serve import add_serve_bench_args
    from mrv2.entrypoints.bench.sweep import add_sweep_args
    from mrv2.entrypoints.bench.throughput import add_throughput_args

    bench = sub.add_parser("bench", help="benchmarks: offline throughput, online serving, "
                                         "engine x precision sweep")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_throughput_args(bench_sub.add_parser("throughput", help="offline throughput"))
    add_serve_bench_args(bench_sub.add_parser(
        "serve", help="latency and throughput of an OpenAI-compatible server"))
    add_sweep_args(bench_sub.add_parser(
        "sweep", help="decode throughput: batch sizes x precisions x engines installed"))


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "throughput":
        from mrv2.entrypoints.bench.throughput import run_throughput

        return run_throughput(args)
    if args.bench_command == "sweep":
        from mrv2.entrypoints.bench.sweep import run_sweep

        return run_sweep(args)
    from mrv2.entrypoints.bench.serve import run_serve_bench

    return run_serve_bench(args)
