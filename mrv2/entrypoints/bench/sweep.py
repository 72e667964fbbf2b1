"""`mrv2 bench sweep`: decode throughput over batch sizes x precisions x the engines installed
(mrv2, transformers, and llama-cpp-python / vLLM where they import), as one table, and as JSON
and a PNG chart on request.

Every engine gets the same prompts (random token ids, seeded: dataset.random_token_prompts),
greedy decoding with EOS ignored, so each writes exactly `--output-len` tokens per prompt, and
the same threads (the cores this process may use). A run of `--output-len` tokens and a run
of 1 token (the prefill and its first token) are timed back to back; the decode throughput is
`batch * (output_len - 1) / (t_full - t_first)` output tokens/s, and t_first is the first-token
time (the prefill) of the second table. Each engine runs every batch
once untimed first (first calls at those shapes), then `--repeats` rounds alternate the
engines, so a change in the machine's load reaches them alike; the table gives the median.

A last column gives each row's roofline limit (sweep_roofline.py): the decode tokens/s no
engine passes reading the checkpoint's weights as stored, at the read bandwidth and float32 GEMM
rate measured right before the engines run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Any

from mrv2.config import KV_CACHE_DTYPES
from mrv2.entrypoints.bench.dataset import random_token_prompts
from mrv2.entrypoints.bench.sweep_engines import (ENGINE_KEYS, MRV2_KEYS, VLLM_KEYS, EngineSpec,
                                                  Skip, SweepModel, SweepSetup, engine_version,
                                                  load_engine, plan_engines, read_sweep_model)

ALIASES = {"mrv2": MRV2_KEYS, "mrv2:bfloat16": ("mrv2:bf16",), "hf": ("transformers",),
           "llama-cpp": ("llama.cpp",), "llama_cpp": ("llama.cpp",), "vllm": VLLM_KEYS,
           "vllm:bfloat16": ("vllm:bf16",)}
METRIC = ("decode output tokens/s = batch * (output_len - 1) / (seconds for output_len tokens "
          "- seconds for 1 token), median over repeats")


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model directory, GGUF file or Hub id (default: the built-in "
                             "SmolLM2-135M-Instruct Q4_1 GGUF)")
    parser.add_argument("--batch-sizes", default="1,8,32",
                        help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (>= 2)")
    parser.add_argument("--engines", default=None,
                        help="comma-separated subset of " + ", ".join(ENGINE_KEYS)
                             + " ('mrv2', 'vllm' = all their precisions; default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of every engine (default: the cores this process may use)")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="mrv2's decode steps per scheduled step (multi-step decoding; "
                             "default: the engine's; not applied to the 'mrv2 defaults' column)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help=f"mrv2's KV cache: {', '.join(KV_CACHE_DTYPES)} (llama.cpp's "
                             f"default is float16)")
    parser.add_argument("--format", choices=["markdown", "text"], default="markdown")
    parser.add_argument("--output-json", default=None, help="write every measurement here")
    parser.add_argument("--output-png", default=None,
                        help="write a bar chart here (needs matplotlib: mrv2[bench])")


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers separated by commas, "
                         f"got {text!r}")
    return sorted(set(sizes))


def parse_engines(text: str | None) -> list[str]:
    """The --engines keys, in the table's column order."""
    if text is None:
        return list(ENGINE_KEYS)
    chosen: set[str] = set()
    for name in (part.strip().lower() for part in text.split(",")):
        keys = ALIASES.get(name, (name,) if name in ENGINE_KEYS else None)
        if keys is None:
            raise ValueError(f"--engines: unknown engine {name!r}; expected some of "
                             f"{', '.join(('mrv2', 'vllm') + ENGINE_KEYS)}")
        chosen.update(keys)
    return [key for key in ENGINE_KEYS if key in chosen]


def check_args(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """Every flag checked before anything is loaded: ValueError naming the bad one."""
    batches = parse_batch_sizes(args.batch_sizes)
    keys = parse_engines(args.engines)
    for flag, value, low in (("--input-len", args.input_len, 1), ("--repeats", args.repeats, 1),
                             ("--output-len", args.output_len, 2),
                             ("--threads", 1 if args.threads is None else args.threads, 1),
                             ("--num-scheduler-steps", 1 if args.num_scheduler_steps is None
                              else args.num_scheduler_steps, 1)):
        if value < low:
            why = " (the decode is the tokens after the first)" if flag == "--output-len" else ""
            raise ValueError(f"{flag} must be >= {low}{why}, got {value}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                         f"{args.kv_cache_dtype!r}")
    if args.output_png is not None:
        from mrv2.entrypoints.bench.sweep_chart import check_matplotlib

        check_matplotlib()
    return batches, keys


def run_sweep(args: argparse.Namespace) -> int:
    from mrv2.entrypoints.bench.sweep_machine import load_average, read_cpu_info
    from mrv2.entrypoints.bench.sweep_table import format_table
    from mrv2.models.builtin import default_model

    batches, keys = check_args(args)
    cpu = read_cpu_info(threads=args.threads)
    model = read_sweep_model(default_model(args.model))
    specs, skips = plan_engines(keys, model, cpu.bf16_precision())
    if not specs:
        raise ValueError("no engine left to run: "
                         + "; ".join(skip.line() for skip in skips))
    setup = SweepSetup(max(batches), args.input_len, args.output_len, args.seed, cpu.threads,
                       args.num_scheduler_steps, args.kv_cache_dtype)
    load_start = load_average()
    roofline = _roofline(model, batches, args, cpu.threads)
    measurements, load_skips = measure(specs, model, setup, batches, args.repeats)
    skips += load_skips
    result = {
        "command": "mrv2 bench sweep",
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "model": model.path,
        "model_name": model.name, "batch_sizes": batches,
        "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
        "seed": args.seed, "metric": METRIC,
        "mrv2_num_scheduler_steps": args.num_scheduler_steps,
        "mrv2_kv_cache_dtype": args.kv_cache_dtype,
        "machine": machine_info(cpu, load_start, load_average()),
        "engines": [{"column": s.column, "engine": s.engine, "precision": s.precision,
                     "version": engine_version(s)} for s in specs
                    if s.column not in {k.engine for k in load_skips}],
        "skipped": [{"engine": s.engine, "reason": s.reason} for s in skips],
        "measurements": measurements}
    if roofline is not None:
        result["roofline"] = roofline
    print(format_table(result, args.format))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.output_png:
        from mrv2.entrypoints.bench.sweep_chart import write_chart

        write_chart(result, args.output_png)
    return 0


def _roofline(model: SweepModel, batches: list[int], args: argparse.Namespace,
              threads: int) -> dict[str, Any] | None:
    from mrv2.entrypoints.bench.sweep_roofline import decode_limit_tok_s, measure_rates

    if model.shapes is None:
        return None
    _progress("measuring the read bandwidth and float32 GEMM rate")
    rates = measure_rates(threads)
    return {"rates": rates.as_json(), "weight_bytes": model.shapes.weight_bytes,
            "decode_tok_s": {str(b): decode_limit_tok_s(model.shapes, b, args.input_len,
                                                        args.output_len, rates)
                             for b in batches}}


def machine_info(cpu: Any, load_start: float | None, load_end: float | None) -> dict[str, Any]:
    import platform

    import torch

    from mrv2.entrypoints.bench.sweep_machine import LOADED_ABOVE

    # The 1-minute load average at the end counts the sweep's own threads; only what is above
    # them is other processes'.
    others = [x for x in (load_start, None if load_end is None else load_end - cpu.threads)
              if x is not None]
    return {"cpu": cpu.as_json(), "threads": cpu.threads, "loadavg_start": load_start,
            "loadavg_end": load_end, "under_load": bool(others) and max(others) > LOADED_ABOVE,
            "python": platform.python_version(), "torch": torch.__version__}


def measure(specs: list[EngineSpec], model: SweepModel, setup: SweepSetup, batches: list[int],
            repeats: int) -> tuple[list[dict[str, Any]], list[Skip]]:
    """Load every engine, time them (see the module docstring), shut them down. An engine that
    fails to load is skipped (returned with why); one that fails mid-way gets "error" cells."""
    prompts = {b: random_token_prompts(b, setup.input_len, model.vocab_size, setup.seed)
               for b in batches}
    engines: list[Any] = []
    skips: list[Skip] = []
    cells = {(s.column, b): _cell(s, b) for s in specs for b in batches}
    try:
        for spec in specs:
            _progress(f"loading {spec.column}")
            try:
                engines.append(load_engine(spec, model, setup))
            except Exception as error:  # noqa: BLE001 - the others still run
                skips.append(Skip(spec.column, f"failed to load: {type(error).__name__}: "
                                               f"{error}"))
                for b in batches:
                    del cells[(spec.column, b)]
        for round_ in range(repeats + 1):  # round 0: untimed
            for b in batches:
                for engine in engines:
                    cell = cells[(engine.spec.column, b)]
                    if cell["status"] == "ok":
                        _time_one(engine, prompts[b], setup, cell, round_ > 0)
    finally:
        for engine in engines:
            engine.shutdown()
    for cell in cells.values():
        _summarise(cell)
    return list(cells.values()), skips


def _cell(spec: EngineSpec, batch: int) -> dict[str, Any]:
    return {"column": spec.column, "engine": spec.engine, "precision": spec.precision,
            "batch": batch, "status": "ok", "note": None, "decode_tok_s": [], "wall_s": [],
            "first_token_s": []}


def _time_one(engine: Any, prompts: list[list[int]], setup: SweepSetup, cell: dict[str, Any],
              timed: bool) -> None:
    output_len = setup.output_len
    try:
        seconds = []
        for n in (output_len, 1):
            set_threads(setup.threads)  # the same cores for every engine
            start = time.perf_counter()
            tokens = engine.generate(prompts, n)
            seconds.append(time.perf_counter() - start)
            if [len(t) for t in tokens] != [n] * len(prompts):
                raise RuntimeError(f"asked for {n} tokens per prompt, got "
                                   f"{[len(t) for t in tokens]}")
    except Exception as error:  # noqa: BLE001 - record it, keep sweeping the others
        cell.update(status="error", note=f"{type(error).__name__}: {error}")
        _progress(f"{cell['column']} batch {cell['batch']}: {cell['note']}")
        return
    if not timed:
        return
    wall, first = seconds
    decode = len(prompts) * (output_len - 1) / (wall - first) if wall > first else None
    cell["wall_s"].append(wall)
    cell["first_token_s"].append(first)
    cell["decode_tok_s"].append(decode)
    rate = f"{decode:.1f} tok/s" if decode is not None else "no decode time (noise)"
    _progress(f"{cell['column']} batch {cell['batch']}: {rate}, {wall:.2f} s")


def _summarise(cell: dict[str, Any]) -> None:
    rates = [r for r in cell["decode_tok_s"] if r is not None]
    ok = cell["status"] == "ok" and bool(rates)
    cell["decode_tok_s_median"] = statistics.median(rates) if ok else None
    cell["wall_s_median"] = statistics.median(cell["wall_s"]) if ok else None
    cell["first_token_s_median"] = statistics.median(cell["first_token_s"]) if ok else None


def set_threads(threads: int) -> None:
    """torch's and numba's pools (mrv2's kernels use both) to `threads`; llama.cpp and vLLM
    are given the count when they load."""
    import numba
    import torch

    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def _progress(line: str) -> None:
    print(f"[sweep] {line}", file=sys.stderr, flush=True)
