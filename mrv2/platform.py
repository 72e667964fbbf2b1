"""Device choice, made once: CUDA when a GPU is visible, else CPU (DESIGN.md section 5).

Each op that has a device-specific implementation asks this module which one to use, so the
rest of the code never branches on `torch.cuda.is_available()` itself.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

# CPU KV cache budget when the user gives none (vLLM's CPU backend uses 4 GiB as well).
DEFAULT_CPU_KV_CACHE_GB = 4.0
# Fraction of free GPU memory handed to the KV cache after weights are loaded.
DEFAULT_GPU_KV_CACHE_FRACTION = 0.8


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


def default_device() -> torch.device:
    return torch.device(device_type())


def default_kv_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_GPU_KV_CACHE_FRACTION)
    return int(DEFAULT_CPU_KV_CACHE_GB * (1 << 30))
