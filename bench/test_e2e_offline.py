"""End-to-end offline throughput on W1/W2/W3 (issue 8), side by side with transformers'
`generate` on the same weights, prompts and thread count, in the same run.

Each round runs HF `generate` (in the untimed setup, timed by hand) and then mrv2 (timed by
pytest-benchmark), so both see the same machine state; `extra_info["mrv2_over_hf"]` is
median(HF seconds) / median(mrv2 seconds): the speed-up, higher is better. Targets: W1 >= 2.0,
W2 >= 1.6, W3 >= 3.0.

Next to it, `limit_s` is the workload's roofline lower bound (bench/roofline.py: FLOPs against
the measured fp32 GEMM rate, bytes against the measured read bandwidth, both measured
right before the case, before its engines are built) and `mrv2_over_limit` / `hf_over_limit` are limit_s / median
seconds: the fraction of the limit each engine reaches (<= 1, higher is closer).

Under `--benchmark-disable` (CI) the workloads shrink to 2 layers and a few tokens
(`Workload.reduced`): the case still runs both engines end to end, in seconds.
"""

from __future__ import annotations

import statistics

import pytest

from e2e_workload import WORKLOADS, HFRunner, Mrv2Runner, throughput_info
from roofline import machine_rates, workload_limit

ROUNDS = 3


@pytest.mark.parametrize("name", ["W1", "W2", "W3"])
def test_offline_vs_hf(benchmark, name):
    workload = WORKLOADS[name]
    if benchmark.disabled:
        workload = workload.reduced()
    # Right before this case, before its engines exist: the bandwidth drifts within minutes.
    rates = machine_rates(quick=benchmark.disabled)
    benchmark.group = f"e2e-{name}"
    mrv2, hf = Mrv2Runner(workload), HFRunner(workload)
    try:
        mrv2.run(), hf.run()  # warm-up: numba/oneDNN first calls, page-in of the weights
        # Same greedy tokens (the models are seeded so near-ties are rare).
        assert mrv2.last_token_ids == hf.last_token_ids
        hf_seconds: list[float] = []

        def setup():
            hf_seconds.append(hf.run())
            return (), {}

        benchmark.pedantic(mrv2.run, setup=setup, rounds=ROUNDS, warmup_rounds=0)
    finally:
        mrv2.shutdown()
    hf_median = statistics.median(hf_seconds)
    stats = getattr(benchmark, "stats", None)
    mrv2_median = stats.stats.median if stats is not None else mrv2.run()
    benchmark.extra_info.update(throughput_info(workload, mrv2_median))
    benchmark.extra_info.update(hf_median_s=hf_median, mrv2_median_s=mrv2_median,
                                mrv2_over_hf=hf_median / mrv2_median, rounds=ROUNDS)
    limit = workload_limit(workload, rates)
    benchmark.extra_info.update(limit_s=limit.limit_s, limit_decode_bound=limit.decode_bound,
                                mrv2_over_limit=limit.limit_s / mrv2_median,
                                hf_over_limit=limit.limit_s / hf_median,
                                gemm_gflop_per_s=rates.gemm_flops_per_s / 1e9,
                                read_gb_per_s=rates.read_bytes_per_s / 1e9)
