"""The fused decode stack's call overhead: numba's dispatcher (every argument typed at every
call) against utils/numba_call.TypedCall (the step's own arrays typed, the model's views once),
on one decode step's arguments of a 30-layer model (the typing grows with the layers; the
kernel's own work here is small, so the difference is the call's). Same run: compare the two
cases' medians."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_model
from mrv2.utils.numba_call import TypedCall


@pytest.fixture(scope="module")
def step_call(tmp_path_factory):
    """(the decode_stack kernel, the arguments of a decode step) from a running engine."""
    path = make_tiny_model(tmp_path_factory.mktemp("bench-models") / "llama30", num_layers=30)
    llm = LLM(str(path), max_model_len=128, num_scheduler_steps=1)
    fused = llm.llm_engine.engine_core.executor.worker.runner.fused_decode
    calls = []
    kernel = fused.args.decode_stack
    fused.args.decode_stack = lambda *args: calls.append(args) or kernel(*args)
    llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    fused.args.decode_stack = kernel
    return kernel.kernel, calls[-1]


@pytest.mark.parametrize("call", ["dispatcher", "typed_call"])
def test_decode_stack_call(benchmark, step_call, call):
    benchmark.group = "decode-stack-call"
    kernel, args = step_call
    run = kernel if call == "dispatcher" else TypedCall(kernel)
    benchmark(run, *args)
