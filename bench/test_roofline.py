"""The roofline limit of W1/W2/W3 (issue 8, bench/roofline.py): the machine's measured fp32
GEMM rate and DRAM read bandwidth, and each workload's lower-bound wall time from them.

The timed case is the measurement itself (one round); what matters is its extra_info: the two
rates and, per workload, `limit_s`, its prefill/decode split and what binds the decode steps.
bench/test_e2e_offline.py divides the same limit by its measured times. Under
`--benchmark-disable` the rates come from the quick (cache-sized) measurement, which only
proves the code runs.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

from e2e_workload import W1, WORKLOADS, Workload
from roofline import MachineRates, decode_step, machine_rates, prefill_flops, workload_limit


def test_machine_rates_and_limits(benchmark):
    benchmark.group = "roofline"
    rates = benchmark.pedantic(machine_rates, kwargs=dict(quick=benchmark.disabled), rounds=1,
                               warmup_rounds=0)
    assert rates.gemm_flops_per_s > 0
    assert rates.read_bytes_per_s == max(rates.sum_bytes_per_s, rates.gemv_bytes_per_s) > 0
    benchmark.extra_info.update(rates=asdict(rates), gemm_gflop_per_s=rates.gemm_flops_per_s / 1e9,
                                read_gb_per_s=rates.read_bytes_per_s / 1e9)
    for name, w in WORKLOADS.items():
        limit = workload_limit(w, rates)
        assert limit.limit_s > 0
        benchmark.extra_info[name] = dict(
            limit_s=limit.limit_s, decode_bound=limit.decode_bound,
            memory_bound_steps=limit.memory_bound_steps, decode_steps=limit.decode_steps,
            prefill_s=limit.prefill_s, decode_s=limit.decode_s,
            output_tokens_per_s=w.num_prompts * w.output_len / limit.limit_s)


# A hand-checked tiny case: the counts below are worked out on paper, not with the module's
# formulas, so a change to the model's arithmetic fails here instead of drifting silently.
# H=8, L=2, 2 heads and 2 KV heads of dim 4 (q = kv = 8), I=16, V=32, 3 prompts of 3 tokens,
# 3 output tokens (2 decode steps, contexts 4 and 5).
# Per layer: 8*(8+16) + 8*8 + 8*32 + 16*8 = 640, so 1280 for both layers; LM head 8*32 = 256.
TINY = Workload("tiny", hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=2,
                intermediate_size=16, vocab_size=32, num_prompts=3, input_len=3, output_len=3)


def _rates(gemm: float, read: float) -> MachineRates:
    return MachineRates(gemm_flops_per_s=gemm, read_bytes_per_s=read, sum_bytes_per_s=read,
                        gemv_bytes_per_s=read, gemm_mkn=(1, 1, 1), read_bytes=1, repeats=1,
                        threads=1, quick=True)


def test_tiny_workload_counts_by_hand():
    # 9 tokens * 2 * 1280 + attention 4*2*8 * (1+2+3) * 3 prompts + LM head 3 * 2 * 256.
    assert prefill_flops(TINY) == 23040 + 1152 + 1536 == 25728
    # FLOPs: 3 * 2 * (1280+256) + 3 * 4*2*8 * c; bytes: 4 * (1280+256) + 3 * c * 2*2*8 * 4.
    assert decode_step(TINY, 4) == (9216 + 768, 6144 + 1536)
    assert decode_step(TINY, 5) == (9216 + 960, 6144 + 1920)


@pytest.mark.parametrize("read, bound, memory_steps, limit_s", [
    (1000.0, "compute", 0, 25.728 + 9.984 + 10.176),  # bytes/s high: FLOPs bind both steps
    (500.0, "memory", 2, 25.728 + 7680 / 500 + 8064 / 500),
    # 7680/780 < 9.984 s of compute at context 4, but 8064/780 > 10.176 at context 5.
    (780.0, "mixed", 1, 25.728 + 9.984 + 8064 / 780),
])
def test_tiny_workload_limit(read, bound, memory_steps, limit_s):
    limit = workload_limit(TINY, _rates(1000.0, read))
    assert (limit.decode_steps, limit.decode_flops, limit.decode_bytes) == (2, 20160, 15744)
    assert limit.prefill_s == pytest.approx(25.728)
    assert (limit.decode_bound, limit.memory_bound_steps) == (bound, memory_steps)
    assert limit.limit_s == pytest.approx(limit_s)
    assert limit.limit_s == pytest.approx(limit.prefill_s + limit.decode_s)


def test_w1_weight_bytes_match_its_shapes():
    # W1's projections as bench/test_model_layers.py lists them: 8 layers of qkv [1024, 512],
    # o [512, 512], gate+up [2816, 512], down [512, 1408], and the LM head [16000, 512].
    params = 8 * (1024 * 512 + 512 * 512 + 2816 * 512 + 512 * 1408) + 16000 * 512
    assert decode_step(W1, 0)[1] == 4 * params
