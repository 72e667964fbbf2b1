"""Host-path micro benches at 256 requests: staged writes, input preparation, detokenizer.

Each group has a naive baseline measured in the same run (compare ratios):
- staged writes: 256 one-value runs staged and applied in one call, vs one torch row write
  per request (what invariant 3 forbids);
- input preparation: `prepare_inputs` for 256 decode rows, vs the list-rebuild reference;
- detokenizer: one incremental decode step for 256 requests, vs `tokenizer.decode` of each
  whole output (what a non-incremental detokenizer does).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_host_workload import DecodeWorkload, ListRebuildReference, make_runner

NUM_REQS = 256
ROUNDS = 50


def _info(benchmark, **extra) -> None:
    benchmark.extra_info.update(num_reqs=NUM_REQS, seed=0, **extra)


# -- staged writes ----------------------------------------------------------------------------
def test_staged_writes(benchmark):
    from mrv2.state.staged import StagedWriteTensor

    benchmark.group = "staged-writes-256"
    _info(benchmark, cols=2048)
    staged = StagedWriteTensor(torch.zeros(NUM_REQS, 2048, dtype=torch.int32))
    rows = np.arange(NUM_REQS)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 2047, NUM_REQS)
    values = rng.integers(0, 1000, NUM_REQS)

    def step() -> None:
        staged.stage_runs(rows, starts, np.ones(NUM_REQS, np.int64), values)
        staged.apply()

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


def test_per_row_writes_reference(benchmark):
    benchmark.group = "staged-writes-256"
    _info(benchmark, cols=2048)
    tensor = torch.zeros(NUM_REQS, 2048, dtype=torch.int32)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 2047, NUM_REQS).tolist()
    values = rng.integers(0, 1000, NUM_REQS).tolist()

    def step() -> None:
        for row in range(NUM_REQS):
            tensor[row, starts[row]] = values[row]

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


# -- input preparation ------------------------------------------------------------------------
def test_prepare_inputs(benchmark):
    from mrv2.inputs.prepare import prepare_inputs

    benchmark.group = "prepare-inputs-256"
    _info(benchmark, block_size=16, prompt_len=32)
    runner = make_runner(NUM_REQS)
    workload = DecodeWorkload(NUM_REQS)
    out = workload.initial_output()
    slots = runner._update_states(out)
    slots = runner.requests.slots_of(list(out.num_scheduled_tokens))
    num_scheduled = np.ones(NUM_REQS, np.int32)
    req_ids = list(out.num_scheduled_tokens)

    def step() -> None:
        prepare_inputs(req_ids, slots, num_scheduled, runner.requests, runner.block_tables,
                       runner.buffers)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


def test_prepare_inputs_list_rebuild_reference(benchmark):
    benchmark.group = "prepare-inputs-256"
    _info(benchmark, block_size=16, prompt_len=32)
    reference = ListRebuildReference()
    workload = DecodeWorkload(NUM_REQS)
    out = workload.initial_output()
    reference.step(out, torch.zeros(NUM_REQS, dtype=torch.int64))
    sampled = torch.zeros(NUM_REQS, dtype=torch.int64)
    benchmark.pedantic(lambda: reference.step(workload.next_output(), sampled),
                       rounds=ROUNDS, warmup_rounds=2)


# -- detokenizer ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from mrv2.testing import get_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(get_tokenizer_dir()))


def _outputs(tokenizer, length: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(0)
    vocab = len(tokenizer)
    prompts = rng.integers(10, vocab, (NUM_REQS, 16)).tolist()
    outputs = rng.integers(10, vocab, (NUM_REQS, length)).tolist()
    return prompts, outputs


def test_detokenizer_incremental(benchmark, tokenizer):
    from mrv2.engine.detokenizer import make_detokenizer
    from mrv2.sampling_params import SamplingParams

    benchmark.group = "detokenizer-256"
    _info(benchmark, output_len=64)
    prompts, outputs = _outputs(tokenizer, 64)
    params = SamplingParams()

    def setup():
        detoks = [make_detokenizer(tokenizer, p, params) for p in prompts]
        for d, o in zip(detoks, outputs):
            d.decode(o[:-1])  # the history: only the last token is timed
        return (detoks,), {}

    def run(detoks) -> None:
        for d, o in zip(detoks, outputs):
            d.decode(o[-1:])

    benchmark.pedantic(run, setup=setup, rounds=10, warmup_rounds=1)


def test_detokenizer_full_decode_reference(benchmark, tokenizer):
    benchmark.group = "detokenizer-256"
    _info(benchmark, output_len=64)
    _, outputs = _outputs(tokenizer, 64)
    benchmark.pedantic(lambda: [tokenizer.decode(o) for o in outputs], rounds=10,
                       warmup_rounds=1)
