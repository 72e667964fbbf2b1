"""The sweep's roofline limit: the checkpoint's shapes, the two machine rates, and the decode
limit memory-bound at small batches and compute-bound at large ones."""

from __future__ import annotations

import pytest

from mrv2.entrypoints.bench.sweep_roofline import (ModelShapes, MachineRates, decode_limit_tok_s,
                                                   measure_rates)

# SmolLM2-135M: 30 layers, hidden 576, 9 x 64 query, 3 x 64 kv, intermediate 1536, vocab 49152
SMOLLM2 = ModelShapes(30, 576, 576, 192, 1536, 49152, weight_bytes=100_000_000)


def test_shapes_count_the_projections_and_the_lm_head():
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    assert SMOLLM2.linear_params == 30 * per_layer + 49152 * 576  # ~134M: the model's size
    assert SMOLLM2.kv_bytes_per_token == 2 * 30 * 192 * 4


def test_limit_is_memory_bound_at_batch_1_and_compute_bound_at_large_batches():
    rates = MachineRates(read_bytes_per_s=20e9, gemm_flops_per_s=100e9, threads=2)
    # batch 1, 1 step attending to 2 positions: the bytes bind (100 MB at 20 GB/s = 5 ms)
    nbytes = SMOLLM2.weight_bytes + 2 * SMOLLM2.kv_bytes_per_token
    assert decode_limit_tok_s(SMOLLM2, 1, 1, 2, rates) == pytest.approx(20e9 / nbytes)
    # batch 256: the FLOPs bind, and the limit stops growing with the batch
    flops = 2 * SMOLLM2.linear_params + 4 * 30 * 576 * 2
    assert decode_limit_tok_s(SMOLLM2, 256, 1, 2, rates) == pytest.approx(100e9 / flops)
    assert decode_limit_tok_s(SMOLLM2, 512, 1, 2, rates) == pytest.approx(100e9 / flops)
    # longer contexts read more KV per step: a lower limit
    assert decode_limit_tok_s(SMOLLM2, 8, 1024, 64, rates) < decode_limit_tok_s(SMOLLM2, 8, 16,
                                                                                  64, rates)


def test_rates_are_measured():
    rates = measure_rates(threads=1, read_mib=8, gemm_size=128, repeats=1)
    assert rates.read_bytes_per_s > 1e8 and rates.gemm_flops_per_s > 1e8 and rates.threads == 1
    assert set(rates.as_json()) == {"read_GB_per_s", "gemm_GFLOP_per_s", "threads"}
