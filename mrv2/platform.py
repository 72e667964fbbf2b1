"""Device choice and kernel choice, each made in one place (DESIGN.md section 5).

Device: CUDA when a GPU is visible, else CPU (`MRV2_DEVICE` forces one).

Kernels: every op with device-specific twins asks `kernel_impl(tensor.device)` which family
runs, so no owner branches on the device itself. CUDA tensors use the Triton kernels; CPU
tensors use the CPU family of the owner (numba for the state and input kernels, torch for the
sampler and attention). Triton is imported only when a Triton kernel is first needed, so a
CPU-only machine without a working Triton never touches it.

One override for tests, `forced_impl(TRITON | CPU)`. `triton_interpreter()` forces TRITON and
runs every kernel launch under Triton's interpreter, so the Triton path runs on CPU tensors;
`kernels_on_cpu("cpu" | "triton")` picks one of the two. Kernels are kept as plain functions
and jitted on first use, once per mode (compiled or interpreted), so both kinds coexist in one
process. Kernels use only `tl` builtins (`tl.full`, not `tl.zeros` or `tl.cdiv`): Triton's own
jitted helpers run under the interpreter only when triton was first imported with
TRITON_INTERPRET=1, which a process that also runs compiled kernels cannot promise.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Iterator

import torch

from mrv2 import cpu_caps

# CPU KV cache budget when the user gives none (vLLM's CPU backend uses 4 GiB as well).
DEFAULT_CPU_KV_CACHE_GB = 4.0
# vLLM's gpu_memory_utilization default: the share of the GPU's whole memory this engine may
# use (weights, activations, KV cache); the KV cache takes what the rest leaves.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# Kernel families: the Triton kernels, and each owner's CPU twin (numba or torch).
TRITON = "triton"
CPU = "cpu"

_forced_impl: str | None = None
_interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
_jitted: dict[tuple[Callable, bool, tuple[str, ...]], Callable] = {}


@lru_cache(maxsize=1)
def device_type() -> str:
    forced = os.environ.get("MRV2_DEVICE")
    if forced:
        if forced not in ("cpu", "cuda"):
            raise ValueError(f"MRV2_DEVICE={forced!r}: expected 'cpu' or 'cuda'")
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


def is_cuda() -> bool:
    return device_type() == "cuda"


def cpu_computes_natively(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix instructions for `dtype` (cpu_caps.CpuCaps.native_16bit):
    what cpu_linear.computes_natively asks, so tests patch it here to run another CPU's
    choices."""
    return cpu_caps.caps().native_16bit(dtype)


def cpu_has_matrix_tiles() -> bool:
    """Whether this CPU has AMX tiles (cpu_caps.CpuCaps.matrix_tiles)."""
    return cpu_caps.caps().matrix_tiles


@lru_cache(maxsize=1)
def last_level_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of this CPU's last-level cache (the highest level sysfs lists for cpu0), or 0
    where sysfs does not say."""
    best_level, best_bytes = 0, 0
    try:
        entries = sorted(os.listdir(sysfs))
    except OSError:
        return 0
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(sysfs, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(sysfs, entry, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        scale = units.get(size[-1:].upper(), 1)
        digits = size[:-1] if size[-1:].upper() in units else size
        if digits.isdigit() and level >= best_level:
            best_level, best_bytes = level, int(digits) * scale
    return best_bytes


def default_device() -> torch.device:
    return torch.device(device_type())


def default_kv_cache_bytes(device: torch.device,
                           gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> int:
    """The KV budget when none is given: on CUDA, `gpu_memory_utilization` of the device's
    memory minus what is in use now (weights, this and other processes); on the CPU a fixed
    size (as vLLM's CPU backend, whose budget is not a share of memory either)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * gpu_memory_utilization - (total - free))
    return int(DEFAULT_CPU_KV_CACHE_GB * (1 << 30))


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install raises more than ImportError
        return False
    return True


def kernel_impl(device: torch.device, *, portable_cpu_impl: bool = False) -> str:
    """The kernel family for tensors on `device`: TRITON for CUDA, CPU for CPU.

    `forced_impl()` overrides it on CPU tensors. An owner whose CPU twin is plain torch and
    runs on any device (attention) passes `portable_cpu_impl=True`: the override then holds on
    every device, and devices other than CUDA use the CPU twin.
    """
    if _forced_impl is not None and (portable_cpu_impl or device.type == "cpu"):
        return _forced_impl
    if device.type == "cuda":
        if not triton_available():
            raise RuntimeError("CUDA tensors need Triton for the state and input kernels, and "
                               "`import triton` failed")
        return TRITON
    if device.type != "cpu" and not portable_cpu_impl:
        raise RuntimeError(f"no state/input kernels for device {device}")
    return CPU


def triton_kernel(fn: Callable, do_not_specialize: tuple[str, ...] = ()) -> Callable:
    """`triton.jit(fn)`, made once per mode: interpreted inside `triton_interpreter()`.

    `do_not_specialize` names the integer arguments that change per step (row and token
    counts, lengths): Triton would otherwise compile a variant for values equal to 1 or
    divisible by 16, i.e. recompile as batches change.
    """
    key = (fn, _interpreting, tuple(do_not_specialize))
    kernel = _jitted.get(key)
    if kernel is None:
        import triton

        kernel = _jitted[key] = triton.jit(fn, do_not_specialize=list(do_not_specialize))
    return kernel


@contextmanager
def forced_impl(impl: str | None) -> Iterator[None]:
    """Use the `impl` kernels (TRITON or CPU; None = by device) inside the block (tests): on
    CPU tensors, and for a `portable_cpu_impl` owner on every device."""
    global _forced_impl
    if impl not in (None, TRITON, CPU):
        raise ValueError(f"impl must be {TRITON!r}, {CPU!r} or None, got {impl!r}")
    previous, _forced_impl = _forced_impl, impl
    try:
        yield
    finally:
        _forced_impl = previous


@contextmanager
def triton_interpreter() -> Iterator[None]:
    """Run the Triton kernels under TRITON_INTERPRET=1 (so on CPU tensors) inside the block.

    Triton reads TRITON_INTERPRET when a function is jitted; kernels jitted here are cached
    apart from the compiled ones.
    """
    global _interpreting
    previous_env = os.environ.get("TRITON_INTERPRET")
    previous = _interpreting
    os.environ["TRITON_INTERPRET"] = "1"
    _interpreting = True
    try:
        with forced_impl(TRITON):
            yield
    finally:
        _interpreting = previous
        if previous_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous_env


def kernels_on_cpu(impl: str):
    """Context: CPU tensors use the `impl` kernels, "cpu" (numba/torch) or "triton"
    (interpreted)."""
    return triton_interpreter() if impl == TRITON else forced_impl(impl)
