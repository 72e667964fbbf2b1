"""Persistent per-request state in fixed slots (DESIGN.md invariants 1, 2 and 4).

A request owns one slot from `add` to `finish`; slots are never moved or compacted, so a
request's rows in every per-slot tensor stay put for its whole life. Free slots form a stack.
This class is the one owner of every per-slot length and counter; other states (the
sampler's, the prompt-logprobs one) read them here. Device tensors hold the truth for what
sampling advances (num_computed, last_sampled, total_len); the host mirrors hold what shapes
and outputs need (prompt_len, prefill_len, and num_computed: the scheduler's count at the
start of each step, advanced by `advance_num_computed_host` when the step's output is made).
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2 import platform
from mrv2.state.staged import StagedWriteTensor


class RequestState:
    def __init__(self, max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = device
        # Stack of free slots: the lowest unused slot first, then the most recently freed.
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.req_id_to_slot: dict[str, int] = {}

        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> StagedWriteTensor:
            return StagedWriteTensor(torch.zeros(*shape, dtype=dtype, device=device))

        # Token history: prefill tokens (prompt + outputs when resumed), then sampled tokens.
        self.token_ids = zeros(max_num_seqs, max_model_len)
        self.prompt_len = zeros(max_num_seqs)
        self.prefill_len = zeros(max_num_seqs)
        self.num_computed = zeros(max_num_seqs)
        self.total_len = zeros(max_num_seqs)
        self.last_sampled = zeros(max_num_seqs, dtype=torch.int64)

        self.prompt_len_host = np.zeros(max_num_seqs, dtype=np.int32)
        self.prefill_len_host = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_computed_host = np.zeros(max_num_seqs, dtype=np.int32)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_active(self) -> int:
        return len(self.req_id_to_slot)

    def add(self, req_id: str, prompt_len: int, prefill_token_ids: list[int],
            num_computed_tokens: int) -> int:
        if req_id in self.req_id_to_slot:
            raise ValueError(f"request {req_id!r} already holds slot "
                             f"{self.req_id_to_slot[req_id]}")
        if not self._free_slots:
            raise RuntimeError(f"no free slot for request {req_id!r}: all "
                               f"{self.max_num_seqs} slots are in use")
        prefill_len = len(prefill_token_ids)
        if prefill_len == 0:
            raise ValueError(f"request {req_id!r} has no prefill tokens")
        if prefill_len > self.max_model_len:
            raise ValueError(f"request {req_id!r} has {prefill_len} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        slot = self._free_slots.pop()
        self.req_id_to_slot[req_id] = slot
        self.token_ids.stage_write(slot, 0, prefill_token_ids)
        self.prompt_len.stage_set(slot, prompt_len)
        self.prefill_len.stage_set(slot, prefill_len)
        self.num_computed.stage_set(slot, num_computed_tokens)
        self.total_len.stage_set(slot, prefill_len)
        self.last_sampled.stage_set(slot, prefill_token_ids[-1])
        self.prompt_len_host[slot] = prompt_len
        self.prefill_len_host[slot] = prefill_len
        self.num_computed_host[slot] = num_computed_tokens
        return slot

    def slots_of(self, req_ids: list[str]) -> np.ndarray:
        """Slots of active requests, as int64 (KeyError for an unknown id)."""
        return np.fromiter(map(self.req_id_to_slot.__getitem__, req_ids), dtype=np.int64,
                           count=len(req_ids))

    def finish(self, req_id: str) -> int | None:
        """Free the request's slot; unknown ids are ignored (a request is freed once)."""
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        return slot

    def set_num_computed_host(self, slots: np.ndarray, num_computed: np.ndarray) -> None:
        """The scheduler's counts for running requests at the start of a step.

        Only the host mirror: the device count was already advanced by `post_update`.
        """
        self.num_computed_host[slots] = num_computed

    def advance_num_computed_host(self, slots: np.ndarray, num_scheduled: np.ndarray
                                  ) -> np.ndarray:
        """Count the step's scheduled tokens on the host mirror, as `post_update` does on the
        device; returns which rows sampled a token (their prefill is now complete)."""
        self.num_computed_host[slots] += num_scheduled
        return self.num_computed_host[slots] >= self.prefill_len_host[slots]

    def apply_staged_writes(self) -> None:
        for staged in (self.token_ids, self.prompt_len, self.prefill_len, self.num_computed,
                       self.total_len, self.last_sampled):
            staged.apply()

    @property
    def _post_update_tensors(self) -> tuple:
        """What the post_update kernels advance, in their argument order."""
        return (self.num_computed, self.prefill_len, self.total_len, self.last_sampled,
                self.token_ids)

    def post_update(self, idx_mapping: torch.Tensor, num_scheduled: torch.Tensor,
                    sampled: torch.Tensor) -> None:
        """Advance counters after sampling, on the device, without reading anything back.

        Per batch row: num_computed += num_scheduled; once the prefill is complete the sampled
        token is appended to the token history (at position num_computed) and becomes
        last_sampled, and total_len = num_computed + 1. Rows whose prefill is still incomplete
        after this step sampled nothing. One kernel launch (Triton on CUDA, numba on CPU).
        """
        tensors = self._post_update_tensors
        if platform.kernel_impl(idx_mapping.device) == platform.CPU:
            from mrv2.state.requests_numba import post_update

            post_update(_host_array(idx_mapping, np.int64), _host_array(num_scheduled, np.int32),
                        _host_array(sampled, np.int64), *(t.numpy for t in tensors))
        else:
            from mrv2.state.requests_triton import post_update

            post_update(idx_mapping, num_scheduled, sampled.contiguous(),
                        *(t.tensor for t in tensors))

    def post_update_steps(self, idx_mapping: torch.Tensor, sampled: torch.Tensor) -> None:
        """`post_update` for a run of decode steps of decode rows (one token a row a step):
        column s of `sampled` [rows, steps] is step s's tokens; one kernel call on the CPU."""
        tensors = self._post_update_tensors
        if platform.kernel_impl(idx_mapping.device) == platform.CPU:
            from mrv2.state.requests_numba import post_update_steps

            post_update_steps(_host_array(idx_mapping, np.int64), _host_array(sampled, np.int64),
                              *(t.numpy for t in tensors))
            return
        ones = torch.ones(idx_mapping.shape[0], dtype=torch.int32, device=idx_mapping.device)
        for step in range(sampled.shape[1]):
            self.post_update(idx_mapping, ones, sampled[:, step])


def _host_array(tensor: torch.Tensor, dtype: type) -> np.ndarray:
    """A CPU tensor as a contiguous numpy array of `dtype` (no copy when it already is one)."""
    return np.ascontiguousarray(tensor.numpy(), dtype=dtype)
