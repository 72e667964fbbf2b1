"""Host side of one runner step at 1..1024 decoding requests, next to the list-rebuild
reference in the same run. Compare ratios, never numbers from another day."""

from __future__ import annotations

import pytest
import torch

from runner_host_workload import (DecodeWorkload, ListRebuildReference, make_runner,
                                  runner_host_step)

SIZES = [1, 64, 256, 1024]
ROUNDS = 60


def _pedantic(benchmark, workload: DecodeWorkload, step, num_reqs: int) -> None:
    sampled = torch.arange(num_reqs, dtype=torch.int64) % 1000
    benchmark.extra_info.update(num_reqs=num_reqs, block_size=16, prompt_len=32)
    benchmark.pedantic(step, setup=lambda: ((workload.next_output(), sampled), {}),
                       rounds=ROUNDS, warmup_rounds=2)


@pytest.mark.parametrize("num_reqs", SIZES)
def test_runner_host_step(benchmark, num_reqs):
    benchmark.group = f"runner-host-{num_reqs}"
    runner = make_runner(num_reqs)
    workload = DecodeWorkload(num_reqs)
    sampled = torch.zeros(num_reqs, dtype=torch.int64)
    runner_host_step(runner, workload.initial_output(), sampled)
    _pedantic(benchmark, workload, lambda out, s: runner_host_step(runner, out, s), num_reqs)


@pytest.mark.parametrize("num_reqs", SIZES)
def test_list_rebuild_reference(benchmark, num_reqs):
    benchmark.group = f"runner-host-{num_reqs}"
    reference = ListRebuildReference()
    workload = DecodeWorkload(num_reqs)
    reference.step(workload.initial_output(), torch.zeros(num_reqs, dtype=torch.int64))
    _pedantic(benchmark, workload, reference.step, num_reqs)
