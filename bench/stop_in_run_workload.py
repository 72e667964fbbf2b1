"""A request that ends on a stop token inside a run of decode steps, at batch 1: the defaults
against the scheduling before 2026-12-07 (async scheduling and runs of 8), same process,
alternating rounds (bench/README.md, "Runs of decode steps as long as 25 ms").

The prompt is 128 token ids; the stop token is the first token of the model's greedy output that
first appears at an output position 3-5 past a multiple of 8 (inside a run). Both engines give
the same tokens; the script checks that, and prints each engine's median milliseconds per
request (prefill included).

    python bench/stop_in_run_workload.py --model /path/to/file.gguf
"""

from __future__ import annotations

import argparse
import statistics
import time

from mrv2 import LLM, SamplingParams

PROMPT = [{"prompt_token_ids": [(13 * j) % 15000 + 100 for j in range(128)]}]
BEFORE = {"async_scheduling": True, "num_scheduler_steps": 8}


def _ms(llm: LLM, params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = llm.generate(PROMPT, params, use_tqdm=False)
    return (time.perf_counter() - start) * 1e3, list(out[0].outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    engines = {"defaults": LLM(args.model, max_model_len=512, enable_prefix_caching=False),
               "before": LLM(args.model, max_model_len=512, enable_prefix_caching=False,
                             **BEFORE)}
    free = _ms(engines["defaults"], SamplingParams(temperature=0, max_tokens=300,
                                                   ignore_eos=True))[1]
    k = next(i for i in range(20, 300) if free.index(free[i]) == i and i % 8 in (3, 4, 5))
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True,
                            stop_token_ids=[free[k]])
    times: dict[str, list[float]] = {name: [] for name in engines}
    for name, llm in engines.items():  # untimed: compiles, caches
        assert _ms(llm, params)[1] == free[:k + 1], name
    for _ in range(args.rounds):
        for name, llm in engines.items():
            ms, tokens = _ms(llm, params)
            assert tokens == free[:k + 1], name
            times[name].append(ms)
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:9s} {k + 1} tokens, stop at output {k}: median {median:.1f} ms per "
              f"request ({', '.join(f'{v:.0f}' for v in values)})")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
