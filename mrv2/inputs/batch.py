"""InputBatch: the views of the step buffers that one step's forward and sampler read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.attention.backend import AttentionMetadata


@dataclass
class InputBatch:
    req_ids: list[str]  # batch order: rows with one query token first
    idx_mapping: torch.Tensor  # [num_reqs] batch row -> slot
    idx_mapping_np: np.ndarray
    num_scheduled: torch.Tensor  # [num_reqs] int32
    num_scheduled_np: np.ndarray
    num_tokens: int  # real tokens
    input_ids: torch.Tensor  # [num_tokens_padded] int32 (padding: 0)
    positions: torch.Tensor  # [num_tokens_padded] int64 (padding: 0)
    logits_indices: torch.Tensor  # [num_reqs]: last token of each row
    attn_metadata: AttentionMetadata
    # Sizes the step is padded to for graph replay (DESIGN.md invariant 6); None = real sizes.
    num_tokens_padded: int | None = None
    num_reqs_padded: int | None = None

    def __post_init__(self) -> None:
        if self.num_tokens_padded is None:
            self.num_tokens_padded = self.num_tokens
        if self.num_reqs_padded is None:
            self.num_reqs_padded = len(self.req_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)
