"""Pipeline stages with micro-batches against one step at a time: offline throughput of
`LLM(..., pipeline_parallel_size=2)` with async scheduling (a step in flight per stage, each
with half of the requests) and without it (one step through both stages at a time), and of
one process, on the W1 model (bench/e2e_workload.py), alternating in one run, medians.

    PYTHONPATH=bench:. .venv/bin/python bench/pp_microbatch_ab.py --rounds 3 --output x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from e2e_workload import W1, make_prompts, model_dir
from mrv2 import LLM, SamplingParams

SETTINGS = {
    "pp2-microbatches": {"pipeline_parallel_size": 2, "async_scheduling": True},
    "pp2-one-step": {"pipeline_parallel_size": 2, "async_scheduling": False},
    "single": {},
}


def one_round(setting: str, prompts: list[list[int]], output_len: int) -> float:
    llm = LLM(str(model_dir(W1)), max_model_len=512, max_num_seqs=len(prompts),
              **SETTINGS[setting])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return len(prompts) * output_len / (time.perf_counter() - start)
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    prompts = make_prompts(W1)[:args.num_prompts]
    rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name in SETTINGS:  # alternating
            rates[name].append(one_round(name, prompts, args.output_len))
            print(f"{name}: {rates[name][-1]:.1f} tok/s", flush=True)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    summary = {"tok_per_s": rates, "median_tok_per_s": medians,
               "microbatches_over_one_step": medians["pp2-microbatches"]
               / medians["pp2-one-step"],
               "microbatches_over_single": medians["pp2-microbatches"] / medians["single"]}
    args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                       **summary}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
