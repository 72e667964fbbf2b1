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
    # Padded to num_tokens_padded for graph replay (DESIGN.md invariant 6).
    input_ids: torch.Tensor  # [num_tokens_padded] int32 (padding: 0)
    positions: torch.Tensor  # [num_tokens_padded] int64 (padding: 0)
    logits_indices: torch.Tensor  # [num_reqs]: last token of each row
    attn_metadata: AttentionMetadata  # rows padded to num_reqs_padded
