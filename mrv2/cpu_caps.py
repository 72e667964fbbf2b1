"""The host CPU's features and the environment switches that choose CPU kernels, read in this
one place, once per process (`caps()`).

Why one place: kernels are chosen at import (numba intrinsics that call x86 instructions by
name, register blocking by vector width) and again at load (oneDNN's matrix units, the GEMV's
activation format); with each module asking LLVM, torch or the environment itself, two of them
could disagree about the machine, and a test had to patch each reader. Here every reader goes
through `CpuCaps`, whose fields are what was read and whose properties are what the kernels
decide from them.

Sources, as each kernel needs:
- LLVM's host features (llvmlite `binding.get_host_cpu_features()`): what numba's generated
  code may use (avx2, avx512f, avx512bw, avx512vnni). LLVM reports a feature only
  where the OS saves its registers too (XCR0), so these are the instructions code may run.
- torch.cpu's probes (cpuinfo, as oneDNN decides): the matrix instructions of oneDNN's 16-bit
  linears (avx512_bf16, amx_tile, amx_fp16) and of its int8 ones (int8_vnni: AVX-512 VNNI).
  Read from torch, not LLVM, because oneDNN is what runs those linears, and tile_linear /
  dot_linear only read the weights oneDNN packed.
- `numba_targets_host`: numba compiles for this machine (no NUMBA_CPU_NAME) and it is x86-64;
  intrinsics naming x86 instructions need both, or they would fault or fail to compile.
- The kernel switches (`KERNEL_SWITCHES`): MRV2_GGUF_ACTIVATIONS, and its older spelling
  MRV2_GGUF_INT8_ACTIVATIONS=1 (= int8), the format of x in the GEMV on GGUF blocks;
  MRV2_GGUF_PREFILL, what a default GGUF model's prompt rows run on (int8 or bf16).

Tests build a `CpuCaps` by hand (every feature defaults to absent) and patch `caps` to run
another CPU's choices; `read()` reads the machine again, uncached.
"""

from __future__ import annotations

import os
import platform as host
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import torch

GGUF_ACTIVATIONS_ENV = "MRV2_GGUF_ACTIVATIONS"
GGUF_INT8_ACTIVATIONS_ENV = "MRV2_GGUF_INT8_ACTIVATIONS"  # =1: the older spelling of int8
# Every environment variable that chooses a kernel: only this module reads them
# (tests/test_cpu_caps.py checks that no other module under mrv2/ does).
GGUF_PREFILL_ENV = "MRV2_GGUF_PREFILL"
KERNEL_SWITCHES: tuple[str, ...] = (GGUF_ACTIVATIONS_ENV, GGUF_INT8_ACTIVATIONS_ENV,
                                    GGUF_PREFILL_ENV)
# The formats of x MRV2_GGUF_ACTIVATIONS names (linear_plan._gemv_x_format maps them to kernels).
GGUF_ACTIVATIONS: tuple[str, ...] = ("float32", "int16", "int8")
# What a default GGUF model's prompt rows run on beside its blocks (MRV2_GGUF_PREFILL): int8
# products where they run (loader.cpu_auto_gguf), or the bfloat16 copies alone.
GGUF_PREFILLS: tuple[str, ...] = ("int8", "bf16")

# CpuCaps field -> LLVM's feature name.
_LLVM_FEATURES = {"avx2": "avx2", "avx512f": "avx512f", "avx512bw": "avx512bw",
                  "avx512vnni": "avx512vnni"}
# CpuCaps field -> torch.cpu's probe (absent from older torch builds: then False).
_TORCH_PROBES = {"avx512_bf16": "_is_avx512_bf16_supported",
                 "amx_tile": "_is_amx_tile_supported", "amx_fp16": "_is_amx_fp16_supported",
                 "int8_vnni": "_is_vnni_supported"}


@dataclass(frozen=True)
class CpuCaps:
    """What this process's kernels may use. Fields are as read (each False where absent);
    properties are the kernel choices derived from them.

    Invariant: `gguf_activations` is "" (unset: the kernels' default) or one of
    GGUF_ACTIVATIONS, `gguf_prefill` "" or one of GGUF_PREFILLS; anything else raises at
    construction, naming the variable."""

    numba_targets_host: bool = False
    avx2: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vnni: bool = False
    avx512_bf16: bool = False
    amx_tile: bool = False
    amx_fp16: bool = False
    int8_vnni: bool = False  # oneDNN's int8 products on VNNI (int8_linear.py)
    gguf_activations: str = ""
    gguf_prefill: str = ""

    def __post_init__(self) -> None:
        if self.gguf_activations and self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"{GGUF_ACTIVATIONS_ENV}={self.gguf_activations!r}: expected one "
                             f"of {sorted(GGUF_ACTIVATIONS)}")
        if self.gguf_prefill and self.gguf_prefill not in GGUF_PREFILLS:
            raise ValueError(f"{GGUF_PREFILL_ENV}={self.gguf_prefill!r}: expected one of "
                             f"{sorted(GGUF_PREFILLS)}")

    @property
    def vector_floats(self) -> int:
        """Floats per vector register of the hand-written IR kernels: 16 with AVX-512 (and its
        32 registers), else 8 (AVX2's 16 registers)."""
        return 16 if self.avx512f else 8

    @property
    def int8_dots(self) -> bool:
        """numba compiles AVX2's integer multiply-adds (quantized_int8_numba.X86_INT8_DOTS):
        the integer-x GEMVs run, so they are the default."""
        return self.numba_targets_host and self.avx2

    @property
    def vnni_dots(self) -> bool:
        """numba compiles AVX-512 VNNI's int8 dot products on 512-bit vectors
        (quantized_vnni_numba.VNNI_DOTS)."""
        return self.numba_targets_host and self.avx512vnni and self.avx512bw and self.avx512f

    @property
    def group_panels(self) -> bool:
        """numba compiles 512-bit vpmaddwd with 32 vector registers, what the int16 group
        panels' kernel needs (quantized_panel_numba.GROUP_PANELS_RUN)."""
        return self.numba_targets_host and self.avx512f and self.avx512bw

    @property
    def matrix_tiles(self) -> bool:
        """AMX tiles: the CPU's matrix units proper (tile_linear), as opposed to AVX-512 BF16's
        vector dot products (dot_linear)."""
        return self.amx_tile

    def native_16bit(self, dtype: torch.dtype) -> bool:
        """Whether the CPU has matrix instructions for `dtype` (bfloat16: AVX-512 BF16 or AMX;
        float16: AMX-FP16; float32 always). Without them a 16-bit matmul is emulated, orders of
        magnitude slower than float32 (bench/README.md), so 16-bit weights compute in
        float32."""
        if dtype == torch.float32:
            return True
        if dtype == torch.bfloat16:
            return self.avx512_bf16 or self.amx_tile
        return dtype == torch.float16 and self.amx_fp16


def _numba_targets_host() -> bool:
    from numba.core import config
    return config.CPU_NAME is None and host.machine().lower() in ("x86_64", "amd64")


def _llvm_features() -> Mapping[str, bool]:
    from llvmlite import binding
    try:
        return binding.get_host_cpu_features()
    except RuntimeError:  # LLVM cannot read this host's features: assume none
        return {}


def read(environ: Mapping[str, str] | None = None) -> CpuCaps:
    """This machine's caps and the kernel switches in `environ` (default os.environ), read
    now; raises ValueError for an unknown MRV2_GGUF_ACTIVATIONS or MRV2_GGUF_PREFILL."""
    environ = os.environ if environ is None else environ
    llvm = _llvm_features()
    features = {field: bool(llvm.get(name, False)) for field, name in _LLVM_FEATURES.items()}
    for field, probe in _TORCH_PROBES.items():
        features[field] = bool(getattr(torch.cpu, probe, lambda: False)())
    choice = environ.get(GGUF_ACTIVATIONS_ENV, "").strip().lower()
    if not choice and environ.get(GGUF_INT8_ACTIVATIONS_ENV, "0") == "1":
        choice = "int8"
    prefill = environ.get(GGUF_PREFILL_ENV, "").strip().lower()
    return CpuCaps(numba_targets_host=_numba_targets_host(), gguf_activations=choice,
                   gguf_prefill=prefill, **features)


@lru_cache(maxsize=1)
def caps() -> CpuCaps:
    """This process's caps, read once: the CPU does not change under a process, and kernels
    chosen at import must keep agreeing with those chosen later."""
    return read()
