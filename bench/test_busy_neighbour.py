"""Batch-1 decode next to a busy process: kernel threads fitted to the free cores
(mrv2/utils/free_cores.py) against a fixed thread count, with and without a neighbour, and
llama.cpp (llama-cpp-python, 2 threads) on the same file where it is installed.

The built-in SmolLM2-135M Q4_1 on its blocks, a 128-token prompt, greedy, 64 tokens, EOS
ignored; the neighbour is a Python busy loop (one core). Each case runs its own LLM in a fresh
process, since the fitting is read when the worker loads; extra_info `decode_tokens_per_s` = 63
/ (median 64-token seconds - median 1-token seconds), 3 rounds each. Compare the cases of one
run (bench/README.md has the figures).

Under `--benchmark-disable` (CI) the cases skip: each needs a model load and a neighbour, and
the fitting itself is tested in tests/utils/test_free_cores.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gguf_workload import gguf_path

_DECODE = r"""
import json, sys, time
from mrv2 import LLM, SamplingParams
llm = LLM(sys.argv[1], quantization="gguf", max_model_len=512, kv_cache_memory_gb=0.5)
prompt = [{"prompt_token_ids": [(t * 104729) % 49000 + 100 for t in range(128)]}]
def run(n):
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                 use_tqdm=False)
    return time.perf_counter() - start
run(8)
long = sorted(run(64) for _ in range(3))[1]
short = sorted(run(1) for _ in range(3))[1]
print(json.dumps({"seconds": long, "decode_tokens_per_s": 63 / (long - short)}))
"""

_DECODE_LLAMA_CPP = r"""
import json, sys, time
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, n_threads_batch=2,
                      verbose=False)
prompt = [(t * 104729) % 49000 + 100 for t in range(128)]
def run(n):
    start = time.perf_counter()
    llm.reset()
    stream = llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0)
    for i, _ in enumerate(stream):
        if i + 1 == n:
            break
    stream.close()
    return time.perf_counter() - start
run(8)
long = sorted(run(64) for _ in range(3))[1]
short = sorted(run(1) for _ in range(3))[1]
print(json.dumps({"seconds": long, "decode_tokens_per_s": 63 / (long - short)}))
"""


@pytest.mark.parametrize("neighbour", [False, True], ids=["alone", "neighbour"])
@pytest.mark.parametrize("engine", ["mrv2-fitted", "mrv2-fixed", "llama.cpp"])
def test_batch_1_decode_next_to_a_busy_process(benchmark, engine, neighbour):
    if benchmark.disabled:
        pytest.skip("timed runs only (see the module docstring)")
    if engine == "llama.cpp":
        pytest.importorskip("llama_cpp")
    script = _DECODE_LLAMA_CPP if engine == "llama.cpp" else _DECODE
    env = {**os.environ,
           "MRV2_FIT_THREADS_TO_FREE_CORES": "1" if engine == "mrv2-fitted" else "0"}
    busy = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour
            else None)
    try:
        time.sleep(0.5)
        result = benchmark.pedantic(
            lambda: json.loads(subprocess.run(
                [sys.executable, "-c", script, str(gguf_path())], env=env, check=True,
                capture_output=True, text=True).stdout.strip().splitlines()[-1]),
            rounds=1, iterations=1)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    benchmark.group = "busy-neighbour-b1"
    benchmark.extra_info.update(engine=engine, neighbour=neighbour, threads=2, batch=1,
                                decode_tokens_per_s=result["decode_tokens_per_s"])
