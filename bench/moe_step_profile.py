"""Per-step figures of a MoE model's decode: router, experts and attention time per step on the
module path (forward hooks on each layer's router, experts and attention: the parts' own wall
time, summed over layers), against the whole step on the module path and on the fused decode
stack (which computes all of them in one call, so only its total is seen).

    PYTHONPATH=. python bench/moe_step_profile.py /tmp/w2models/qwen3-moe-q8_0.gguf [batch]

Prints one JSON object: milliseconds per decode step (medians over the decode steps of a run
of 64 tokens), the batch, the CPU and the load average.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

from mrv2 import LLM, SamplingParams
from mrv2.entrypoints.bench.sweep_machine import load_average, read_cpu_info

PARTS = {"attention": "self_attn", "router": "mlp.gate", "experts": "mlp.experts"}


def _hook_parts(model, times: dict[str, list[float]]) -> None:
    """Forward hooks adding each part's wall time per call to times[part] (a decode step's
    calls, one per layer, are summed by `_per_step`)."""
    for layer in model.model.layers:
        for part, name in PARTS.items():
            module = layer.get_submodule(name)
            start: list[float] = []
            module.register_forward_pre_hook(lambda *_, s=start: s.append(time.perf_counter()))
            module.register_forward_hook(
                lambda *_, s=start, p=part: times[p].append(time.perf_counter() - s.pop()))


def _step_ms(llm: LLM, runner, batch: int, tokens: int) -> list[float]:
    """Wall time of each decode step (ms) of a run of `tokens` greedy tokens from `batch`
    prompts."""
    steps: list[float] = []
    real = runner.execute_model

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = real(*args, **kwargs)
        steps.append((time.perf_counter() - start) * 1e3)
        return out

    runner.execute_model = timed
    prompts = [{"prompt_token_ids": list(range(10 + i, 42 + i))} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    del runner.execute_model
    return steps[1:]  # the first is the prefill


def main(path: str, batch: int = 1, tokens: int = 64) -> dict:
    llm = LLM(path, quantization="gguf", max_model_len=256, enable_prefix_caching=False,
              max_num_seqs=max(batch, 1))
    runner = llm.llm_engine.engine_core.executor.worker.runner
    fused = runner.fused_decode
    _step_ms(llm, runner, batch, 8)  # warm up (compiles)
    stack = statistics.median(_step_ms(llm, runner, batch, tokens))
    runner.fused_decode = None  # the module path, op by op
    times: dict[str, list[float]] = defaultdict(list)
    _hook_parts(runner.model, times)
    _step_ms(llm, runner, batch, 8)
    times.clear()
    module = statistics.median(_step_ms(llm, runner, batch, tokens))
    layers = len(runner.model.model.layers)
    # each part's calls per step (one per layer); the first step is the prefill's
    per_step = {part: 1e3 * statistics.median(sum(t[i:i + layers])
                                              for i in range(layers, len(t), layers))
                for part, t in times.items()}
    runner.fused_decode = fused
    llm.shutdown()
    return {"model": path, "batch": batch, "cpu": read_cpu_info().kind, "load": load_average(),
            "module_path_step_ms": round(module, 3),
            **{f"module_path_{part}_ms": round(ms, 3) for part, ms in per_step.items()},
            "fused_stack_step_ms": round(stack, 3)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1),
                     indent=1))
