"""Per-slot sampling parameters, staged when a request is added.

The sampler reads them through the batch-row -> slot mapping, so no per-step parameter tensor
is built in Python. Host mirrors decide which pipeline stages a batch needs without reading
the device.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from mrv2.sampling_params import SamplingParams
from mrv2.state.staged import StagedWriteTensor

_SEED_MASK = (1 << 63) - 1


def request_seed(params: SamplingParams, engine_seed: int, req_id: str) -> int:
    """The request's own seed, or one derived from the engine seed and its id (stable across
    processes, unlike Python's `hash`)."""
    if params.seed is not None:
        return params.seed & _SEED_MASK
    # An odd 64-bit multiplier spreads every bit of the engine seed over the result.
    mixed = (engine_seed * 0x9E3779B97F4A7C15 + zlib.crc32(req_id.encode())) & _SEED_MASK
    return mixed


class SamplingStates:
    def __init__(self, max_num_seqs: int, engine_seed: int, device: torch.device) -> None:
        self.engine_seed = engine_seed

        def table(dtype: torch.dtype) -> StagedWriteTensor:
            return StagedWriteTensor(torch.zeros(max_num_seqs, dtype=dtype, device=device))

        self.temperature = table(torch.float32)
        self.top_k = table(torch.int32)
        self.top_p = table(torch.float32)
        self.min_p = table(torch.float32)
        self.seed = table(torch.int64)
        self.temperature_host = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_k_host = np.zeros(max_num_seqs, dtype=np.int32)
        self.top_p_host = np.ones(max_num_seqs, dtype=np.float32)
        self.min_p_host = np.zeros(max_num_seqs, dtype=np.float32)

    def add(self, slot: int, req_id: str, params: SamplingParams) -> None:
        # top_k == 1 is greedy: store it as temperature 0 so the row takes the argmax path.
        temperature = 0.0 if params.top_k == 1 else params.temperature
        top_k = max(params.top_k, 0)
        self.temperature.stage_set(slot, temperature)
        self.top_k.stage_set(slot, top_k)
        self.top_p.stage_set(slot, params.top_p)
        self.min_p.stage_set(slot, params.min_p)
        self.seed.stage_set(slot, request_seed(params, self.engine_seed, req_id))
        self.temperature_host[slot] = temperature
        self.top_k_host[slot] = top_k
        self.top_p_host[slot] = params.top_p
        self.min_p_host[slot] = params.min_p

    def apply_staged_writes(self) -> None:
        for staged in (self.temperature, self.top_k, self.top_p, self.min_p, self.seed):
            staged.apply()

    def batch_flags(self, idx_mapping_np: np.ndarray) -> dict[str, bool]:
        """Which stages the rows of this batch use, from the host mirrors only."""
        greedy = self.temperature_host[idx_mapping_np] == 0.0
        random = ~greedy
        return {
            "all_greedy": bool(greedy.all()),
            "all_random": bool(random.all()),
            "any_top_k": bool((random & (self.top_k_host[idx_mapping_np] > 0)).any()),
            "any_top_p": bool((random & (self.top_p_host[idx_mapping_np] < 1.0)).any()),
            "any_min_p": bool((random & (self.min_p_host[idx_mapping_np] > 0.0)).any()),
        }
