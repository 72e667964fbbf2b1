"""The roofline limit of each `mrv2 bench sweep` row: the decode tokens/s that no engine passes
on this machine reading the checkpoint's weights as stored and computing in float32.

A decode step of `batch` rows reads every weight of the layers and the LM head once (the bytes
the checkpoint stores them in: a GGUF file's blocks, a directory's safetensors) plus each row's
K and V (float32, as the engines here keep them), and does 2 FLOPs per weight per row plus
attention's 4 * layers * q_dim per attended position. It lasts at least
max(bytes / read bandwidth, FLOPs / GEMM rate); the sweep's output_len - 1 steps, step j
attending to input_len + j positions, give the limit's decode time and tokens/s. Both rates are
measured here, right before the engines run, on the sweep's threads, each the best of its
repeats (a ceiling, as a limit needs): the read bandwidth as a `torch.sum` streaming 256 MiB
from DRAM, the GEMM rate as a large float32 `torch.mm`. Norms, rotary, sampling, scheduling and
Python are left out: they only add time. A MoE model's step reads and multiplies its top-k
experts of each layer (the least any batch reads: all rows may choose the same ones). An engine
computing in int8, or in bfloat16 on matrix units, may pass the float32 compute ceiling at
large batches: the limit is float32's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

F32_BYTES = 4


@dataclass(frozen=True)
class ModelShapes:
    """What the limit needs of a decoder checkpoint."""

    layers: int
    hidden: int
    q_dim: int  # heads * head_dim
    kv_dim: int  # kv heads * head_dim
    intermediate: int
    vocab: int
    weight_bytes: int  # the layers' and the LM head's weights as the checkpoint stores them

    @property
    def linear_params(self) -> int:
        """Weights a decode row multiplies: every projection and the LM head."""
        h = self.hidden
        per_layer = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * self.intermediate
        return self.layers * per_layer + self.vocab * h

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_dim * F32_BYTES


@dataclass(frozen=True)
class MachineRates:
    read_bytes_per_s: float
    gemm_flops_per_s: float
    threads: int

    def as_json(self) -> dict[str, float]:
        return {"read_GB_per_s": self.read_bytes_per_s / 1e9,
                "gemm_GFLOP_per_s": self.gemm_flops_per_s / 1e9, "threads": self.threads}


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page-in, oneDNN's first call
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_rates(threads: int, read_mib: int = 256, gemm_size: int = 1536,
                  repeats: int = 5) -> MachineRates:
    """The read bandwidth and float32 GEMM rate on `threads` threads (torch's count restored)."""
    import torch

    def read_seconds() -> float:
        big = torch.ones(read_mib * 2**20 // F32_BYTES)  # written once: every page resident
        return _best_seconds(lambda: torch.sum(big), repeats)

    def gemm_seconds() -> float:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(gemm_size, gemm_size, generator=g)
        b = torch.randn(gemm_size, gemm_size, generator=g)
        return _best_seconds(lambda: torch.mm(a, b), repeats)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        read_s, gemm_s = read_seconds(), gemm_seconds()
    finally:
        torch.set_num_threads(previous)
    return MachineRates(read_mib * 2**20 / read_s, 2 * gemm_size**3 / gemm_s, threads)


def decode_limit_tok_s(shapes: ModelShapes, batch: int, input_len: int, output_len: int,
                       rates: MachineRates) -> float:
    """The most decode output tokens/s (the sweep's metric: batch * (output_len - 1) over the
    decode steps' time) any engine reaches; see the module docstring."""
    seconds = 0.0
    for j in range(1, output_len):
        context = input_len + j
        nbytes = shapes.weight_bytes + batch * context * shapes.kv_bytes_per_token
        flops = batch * (2 * shapes.linear_params + 4 * shapes.layers * shapes.q_dim * context)
        seconds += max(nbytes / rates.read_bytes_per_s, flops / rates.gemm_flops_per_s)
    return batch * (output_len - 1) / seconds
