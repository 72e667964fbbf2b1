"""A roofline lower bound on the wall time of an e2e workload (issue 8): how fast could any
fp32 engine on these 2 cores run W1/W2/W3, given the machine's measured GEMM rate and DRAM
read bandwidth?

`machine_rates` measures the two ceilings on `NUM_THREADS` threads: the GEMM on the engine's
own path (oneDNN with a packed weight) and the read bandwidth as the faster of a streaming
`torch.sum` and the engine's 1-row GEMV (either wins by ~10% from run to run; with one reader
alone the bound could undercut the engine). Each rate is the best of its repeats: a ceiling,
as a lower bound needs. The DRAM bandwidth of this shared host moves by up to 2x within
minutes (45 to 85 GB/s seen), which is why each e2e case measures the rates right before it
runs.
`workload_limit` counts the FLOPs and bytes a Llama decoder of the workload's shapes must spend
and turns them into seconds. The bound leaves out everything that is not a weight GEMM, an
attention dot product, or a weight / KV-cache read (norms, activations, rotary, sampling,
scheduling, Python, embedding lookups), so a real engine can only come near it from above:
`limit_s / measured_s` is a fraction <= 1, "how close to the limit". Both rates are the best
case of their kind (a large square GEMM, a sequential read), so a 32-row decode GEMM or a
paged KV read runs no faster than the bound assumes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from e2e_workload import NUM_THREADS, Workload

F32_BYTES = 4
Resource = Literal["compute", "memory", "mixed"]


@dataclass(frozen=True)
class _Sizes:
    gemm_mkn: tuple[int, int, int]
    read_mib: int
    repeats: int


# Full sizes: a GEMM large enough to be compute-bound at oneDNN's best blocking, and a read
# 8x the 32 MiB L3 so the sum streams from DRAM. Quick sizes (CI under --benchmark-disable)
# only prove the code runs; their read fits in the L3, so that "bandwidth" is not DRAM's.
_FULL = _Sizes(gemm_mkn=(2048, 2048, 2048), read_mib=256, repeats=7)
_QUICK = _Sizes(gemm_mkn=(512, 512, 512), read_mib=16, repeats=2)
_GEMV_K = 1024  # W2's hidden size: the K of most of its decode GEMVs


@dataclass(frozen=True)
class MachineRates:
    gemm_flops_per_s: float  # best over `repeats` of 2*M*K*N / seconds
    read_bytes_per_s: float  # the faster of the two readers below, the bound's bandwidth
    sum_bytes_per_s: float  # torch.sum over read_bytes: best over `repeats`
    gemv_bytes_per_s: float  # cpu_gemv.gemv, 1 row, the same bytes as a [N, 1024] weight
    gemm_mkn: tuple[int, int, int]  # x [M, K] @ weight [N, K].T
    read_bytes: int
    repeats: int
    threads: int
    quick: bool


@dataclass(frozen=True)
class Limit:
    """Roofline lower bound for one workload; see `workload_limit`."""

    workload: str
    prefill_flops: float
    decode_steps: int
    decode_flops: float  # summed over the decode steps
    decode_bytes: float  # summed over the decode steps
    prefill_s: float
    decode_s: float
    limit_s: float  # prefill_s + decode_s
    decode_bound: Resource  # what binds the decode steps: all compute, all memory, or both
    memory_bound_steps: int


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: oneDNN's JIT and the weight packing, page-in, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def machine_rates(quick: bool = False) -> MachineRates:
    """Measure the fp32 GEMM rate and the read bandwidth on `NUM_THREADS` threads (torch's and
    numba's counts restored afterwards). Full sizes cost about a second; `quick=True` well
    under that."""
    import numba

    from mrv2.models.layers import cpu_gemv, cpu_linear

    sizes = _QUICK if quick else _FULL
    m, k, n = sizes.gemm_mkn
    repeats = sizes.repeats
    previous, previous_numba = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    # numba's pool (the GEMV) is sized apart from torch's; cap it the same way.
    numba.set_num_threads(min(NUM_THREADS, numba.config.NUMBA_NUM_THREADS))
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        # inference_mode: cpu_linear takes the oneDNN path (weight packed once, cached on `w`)
        # only outside autograd, as in the engine's forward pass.
        with torch.inference_mode():
            gemm_s = _best_seconds(lambda: cpu_linear.linear(x, w), repeats)
        del x, w
        read_bytes = sizes.read_mib * 2**20
        big = torch.ones(read_bytes // F32_BYTES)  # written once so every page is resident
        sum_s = _best_seconds(lambda: torch.sum(big), repeats)
        weight, row = big.view(-1, _GEMV_K), torch.ones(1, _GEMV_K)
        gemv_s = _best_seconds(lambda: cpu_gemv.gemv(row, weight), repeats)
        del big, weight
    finally:
        torch.set_num_threads(previous)
        numba.set_num_threads(previous_numba)
    sum_rate, gemv_rate = read_bytes / sum_s, read_bytes / gemv_s
    return MachineRates(gemm_flops_per_s=2 * m * k * n / gemm_s,
                        read_bytes_per_s=max(sum_rate, gemv_rate), sum_bytes_per_s=sum_rate,
                        gemv_bytes_per_s=gemv_rate, gemm_mkn=(m, k, n), read_bytes=read_bytes,
                        repeats=repeats, threads=NUM_THREADS, quick=quick)


@dataclass(frozen=True)
class _Shapes:
    layer_params: int  # all decoder layers' projection weights (norm weights left out: tiny)
    head_params: int  # untied LM head, H*V
    q_dim: int
    kv_dim: int


def _shapes(w: Workload) -> _Shapes:
    h, i = w.hidden_size, w.intermediate_size
    head_dim = h // w.num_heads
    q, kv = w.num_heads * head_dim, w.num_kv_heads * head_dim
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h  # qkv, o, gate+up, down
    return _Shapes(w.num_layers * per_layer, h * w.vocab_size, q, kv)


def prefill_flops(w: Workload) -> float:
    """Every prompt token through the layers (2 FLOPs per weight), causal attention (QK^T and
    PV: 4*L*q_dim FLOPs per attended token, token p attends to p+1), and the LM head for each
    prompt's last token only (the one that samples the first output token)."""
    s = _shapes(w)
    tokens = w.num_prompts * w.input_len
    attended = w.num_prompts * w.input_len * (w.input_len + 1) // 2
    return (tokens * 2 * s.layer_params + attended * 4 * w.num_layers * s.q_dim
            + w.num_prompts * 2 * s.head_params)


def decode_step(w: Workload, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step: `num_prompts` rows, each attending to `context`
    tokens. Bytes: every weight read once for the whole batch, plus each row's K and V."""
    s, b = _shapes(w), w.num_prompts
    flops = b * (2 * s.layer_params + 2 * s.head_params) + b * 4 * w.num_layers * s.q_dim * context
    nbytes = (F32_BYTES * (s.layer_params + s.head_params)
              + b * context * w.num_layers * 2 * s.kv_dim * F32_BYTES)
    return flops, nbytes


def workload_limit(w: Workload, rates: MachineRates) -> Limit:
    """A lower bound on the workload's wall time: no engine overhead, perfect overlap of
    compute and memory within a step, nothing but GEMMs, attention and weight/KV reads.

    The prefill is counted as compute-bound (its weight reads are amortised over
    num_prompts*input_len rows). The first output token comes from the prefill, so there are
    output_len-1 decode steps; step j (1-based) feeds position input_len+j-1 and attends to
    context input_len+j. A step costs max(FLOPs / GEMM rate, bytes / read bandwidth).
    """
    p_flops = prefill_flops(w)
    steps = max(w.output_len - 1, 0)
    d_flops = d_bytes = decode_s = 0.0
    memory_bound = 0
    for j in range(1, steps + 1):
        flops, nbytes = decode_step(w, w.input_len + j)
        compute_s, memory_s = flops / rates.gemm_flops_per_s, nbytes / rates.read_bytes_per_s
        memory_bound += memory_s > compute_s
        d_flops, d_bytes = d_flops + flops, d_bytes + nbytes
        decode_s += max(compute_s, memory_s)
    bound: Resource = ("compute" if memory_bound == 0 else
                       "memory" if memory_bound == steps else "mixed")
    prefill_s = p_flops / rates.gemm_flops_per_s
    return Limit(workload=w.name, prefill_flops=p_flops, decode_steps=steps,
                 decode_flops=d_flops, decode_bytes=d_bytes, prefill_s=prefill_s,
                 decode_s=decode_s, limit_s=prefill_s + decode_s, decode_bound=bound,
                 memory_bound_steps=memory_bound)
