"""What a JSON-schema grammar costs a decode step (issue 17 target: at most 10% of the step with
32 of 32 requests constrained, on the W1 model), and how long a schema takes to compile.

One LLM (W1's model: hidden 512, 8 layers, vocab 16000, with its tokenizer), 32 requests of
the same prompts, alternately free and under a JSON schema whose string field keeps a random
model writing (it may close the string and stop early: only steps with all 32 requests
running count). `EngineCore.step` is timed per step; the median over those steps is each
round's figure, and the ratio constrained / free is taken within the run. Compile time: a
fresh schema (never cached) through the engine's compiler, median of several.
"""

from __future__ import annotations

import json
import statistics
import time

from mrv2 import LLM, SamplingParams
from mrv2.sampling_params import StructuredOutputsParams

NUM_REQS = 32
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["title", "year", "tags"]}


def _llm(reduced: bool) -> LLM:
    from e2e_workload import W1, model_dir

    w = W1.reduced() if reduced else W1
    return LLM(str(model_dir(w)), dtype="float32", max_model_len=256, max_num_seqs=NUM_REQS,
               seed=0, enable_prefix_caching=False)


def _full_batch_step_times(llm: LLM, params: SamplingParams) -> list[float]:
    """Seconds of each EngineCore.step that started with all NUM_REQS requests running."""
    core = llm.llm_engine.engine_core
    times: list[float] = []
    step = core.step

    def timed():
        full = core.scheduler.num_running == NUM_REQS
        start = time.perf_counter()
        try:
            return step()
        finally:
            if full:
                times.append(time.perf_counter() - start)

    core.step = timed
    try:
        llm.generate(["Write a JSON record:"] * NUM_REQS, [params] * NUM_REQS, use_tqdm=False)
    finally:
        del core.step
    return times


def test_grammar_share_of_the_step(benchmark, two_threads):
    benchmark.group = "structured-outputs"
    llm = _llm(reduced=benchmark.disabled)
    max_tokens = 4 if benchmark.disabled else 48
    free = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    constrained = free.clone(structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True))
    _full_batch_step_times(llm, constrained)  # warm-up: compile, kernels
    rounds = 1 if benchmark.disabled else 3
    ratios, medians = [], {"free": [], "json": []}
    for _ in range(rounds):
        for name, params in (("free", free), ("json", constrained)):
            times = _full_batch_step_times(llm, params)
            assert times, f"no step ran with all {NUM_REQS} requests ({name})"
            medians[name].append(statistics.median(times))
        ratios.append(medians["json"][-1] / medians["free"][-1])
    benchmark.extra_info.update(
        step_ms_free=[round(m * 1e3, 3) for m in medians["free"]],
        step_ms_json=[round(m * 1e3, 3) for m in medians["json"]],
        json_over_free=[round(r, 3) for r in ratios],
        loadavg=open("/proc/loadavg").read().split()[:3])
    benchmark.pedantic(lambda: None, rounds=1)
    llm.shutdown()


def test_schema_compile_time(benchmark, two_threads):
    """A schema never seen before (a new property name each time), compiled for the W1 model's
    vocabulary; xgrammar's cache would make a repeat free."""
    benchmark.group = "structured-outputs"
    from mrv2.config import StructuredOutputsConfig
    from mrv2.core.grammar import GrammarCompiler
    from mrv2.models.tokenizer import load_tokenizer

    from e2e_workload import W1, model_dir

    compiler = GrammarCompiler(load_tokenizer(str(model_dir(W1))), W1.vocab_size, [1],
                               StructuredOutputsConfig())
    counter = iter(range(10**6))

    def compile_fresh():
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"field_{next(counter)}"] = {"type": "number"}
        compiler.compile(StructuredOutputsParams(json=schema))

    benchmark.pedantic(compile_fresh, rounds=1 if benchmark.disabled else 10, iterations=1)
