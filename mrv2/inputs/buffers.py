"""Persistent per-step input buffers (DESIGN.md invariant 2).

Allocated once with fixed addresses and fixed capacity (max_num_batched_tokens tokens,
`max_step_rows` rows); every step writes a prefix of them. A captured graph can therefore read the
same addresses on every replay. Entries past a step's padded sizes keep stale values, except
slot_mapping, which is -1 past the real tokens (nothing there writes the KV cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mrv2.state.host_staging import HostStaging

if TYPE_CHECKING:
    from mrv2.config import EngineConfig


def max_step_rows(config: EngineConfig) -> int:
    """The most rows a step holds: one per request, or with speculative decoding one per token
    a request verifies (its sampled token and its drafts: inputs/prepare.verify_rows), within
    the step's token budget."""
    sched, spec = config.scheduler_config, config.speculative_config
    if spec is None:
        return sched.max_num_seqs
    return max(sched.max_num_seqs, min(sched.max_num_batched_tokens,
                                       sched.max_num_seqs * (1 + spec.num_speculative_tokens)))


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 device: torch.device, num_kv_groups: int = 1) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs

        def buf(*shape: int, dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = buf(max_num_tokens, dtype=torch.int32)
        self.positions = buf(max_num_tokens, dtype=torch.int64)
        # One row per KV cache group (core/kv_cache_layout.py). -1 from the start: a warm-up
        # or capture run before the first step writes no KV.
        self.slot_mapping = buf(num_kv_groups, max_num_tokens, dtype=torch.int64, fill=-1)
        self.query_start_loc = buf(max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = buf(max_num_reqs, dtype=torch.int32)
        self.idx_mapping = buf(max_num_reqs, dtype=torch.int64)
        self.num_scheduled = buf(max_num_reqs, dtype=torch.int32)
        self.logits_indices = buf(max_num_reqs, dtype=torch.int64)
        self.block_tables = buf(num_kv_groups, max_num_reqs, max_num_blocks_per_req,
                                dtype=torch.int32)
        # The step's host data (idx_mapping, num_scheduled, query_start_loc) goes to the device
        # in one double-buffered upload.
        self.staging = HostStaging(torch.device(device))
        self._outputs = (self.idx_mapping, self.num_scheduled, self.query_start_loc,
                         self.seq_lens, self.logits_indices, self.input_ids, self.positions,
                         self.slot_mapping, self.block_tables)
        self._numpy_outputs: tuple[np.ndarray, ...] | None = None

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """What input preparation writes, in the kernels' argument order: idx_mapping,
        num_scheduled, query_start_loc, seq_lens, logits_indices, input_ids, positions,
        slot_mapping, block_tables."""
        return self._outputs

    def numpy_outputs(self) -> tuple[np.ndarray, ...]:
        """`outputs()` as shared-memory numpy views (CPU buffers only)."""
        if self._numpy_outputs is None:
            self._numpy_outputs = tuple(t.numpy() for t in self._outputs)
        return self._numpy_outputs
