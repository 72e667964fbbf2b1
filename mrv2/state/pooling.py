"""Pooled hidden states of a "pooling" runner (ModelConfig.runner), per slot.

Every request of a pooling engine is a prompt whose final-norm hidden states (what the model's
forward returns, before the LM head) are pooled once its prefill completes; the runner asks
`pool` for each step's rows in phase 2 and ships the finishing rows' vectors with the step's
one output copy.

- LAST: the hidden state of the row's last scheduled token (its logits index). The step that
  completes a prefill always computes the last prompt token (a prefix-cache hit never covers
  it), so prefix caching stays on.
- MEAN: a float32 running sum per slot over the prefill chunks (zeroed when a request is added
  to the slot, one launch per step for all the step's new requests; summed per step by one
  index_add over the step's tokens, no loop over requests) divided by the prompt length.
  Every prompt token must be computed, so the engine refuses prefix caching with MEAN
  (EngineConfig). A preempted request is re-added, so its sum starts over.

Rows whose prefill is still incomplete get a partial value that nobody reads.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.config import PoolerConfig
from mrv2.inputs.batch import InputBatch
from mrv2.state.host_staging import upload_array


class PoolingState:
    def __init__(self, pooler_config: PoolerConfig, max_num_seqs: int, hidden_size: int,
                 device: torch.device) -> None:
        self.pooling_type = pooler_config.pooling_type
        self.device = device
        self.sums: torch.Tensor | None = None
        if self.pooling_type == "MEAN":
            self.sums = torch.zeros(max_num_seqs, hidden_size, dtype=torch.float32,
                                    device=device)
        self._added: list[int] = []  # slots whose sums start over at the next apply

    def add(self, slot: int) -> None:
        """A request took `slot` (new, or resumed after preemption)."""
        if self.sums is not None:
            self._added.append(slot)

    def apply_staged_writes(self) -> None:
        """Zero the sums of the slots added since the last call: one launch."""
        if self._added:
            slots = upload_array(np.array(self._added, dtype=np.int64), self.device)
            self.sums.index_fill_(0, slots, 0.0)
            self._added.clear()

    def pool(self, hidden_states: torch.Tensor, last_hidden: torch.Tensor, batch: InputBatch,
             prompt_len: torch.Tensor) -> torch.Tensor:
        """[num_reqs, hidden] float32, batch order. `hidden_states`: the step's [num_tokens,
        hidden]; `last_hidden`: its rows at the logits indices; `prompt_len`: per slot."""
        if self.sums is None:  # LAST
            return last_hidden.float()
        n = batch.num_tokens
        rows = torch.repeat_interleave(batch.idx_mapping, batch.num_scheduled, output_size=n)
        self.sums.index_add_(0, rows, hidden_states[:n].float())
        idx = batch.idx_mapping
        return self.sums[idx] / prompt_len[idx].unsqueeze(1)
