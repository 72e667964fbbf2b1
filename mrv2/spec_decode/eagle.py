"""EAGLE speculation: a draft head proposes each request's next tokens from the target's
hidden states (speculative_config method "eagle": models/eagle.py, fed the target's final
hidden states; "eagle3": models/eagle3.py, fed three of its layers' input streams, which the
target outputs beside them, LlamaModel.aux_hidden_states, mapped to one feature by the head's
`target_features`).

The head's KV cache (its own layers') has the target's block count and is indexed by the
target's block tables, as a draft model's (draft_model.py): the scheduler's lookahead slots
hold the KV of its drafts. At position p the head reads the target's feature at p and the
token at p + 1, so its KV at p needs both. Its drafts are greedy (`next_tokens`).

Per step (phase 2, after the target's tokens are kept), `EagleProposer.propose`:
1. Catch-up, for every request that may draft and is not backing off (drafts.py), prefill
   chunks included: the head runs over the positions the target kept this step (a prefill
   chunk's, a decode row's one, a verify row's sampled token and accepted drafts), fed the
   step's hidden states at those positions, which replaces the KV its drafts wrote there.
   Positions of steps it skipped (a backoff; a multi-step run's steps but its last, whose
   hidden states the run returns) keep what was there, as do prefix-cache blocks
   another request's head wrote (vLLM's choice too): only its drafts' acceptance can suffer,
   never the output, which the target verifies.
2. The head's output at each drafting request's last kept position gives its first draft
   (argmax of the LM head: the head's own, else the target's); each further draft is one
   decode forward of the head at the next position, fed its own last output as the feature
   and the draft before it as the token.
The drafts go into the request's token history after its last token (DraftState's place);
every head forward reads its tokens from that history, one past each position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mrv2.inputs.buffers import InputBuffers
from mrv2.inputs.prepare import decode_first_order, prepare_inputs, run_offsets
from mrv2.spec_decode.draft_model import DraftModel
from mrv2.state.block_table import BlockTables
from mrv2.state.requests import RequestState


@dataclass(frozen=True)
class TargetStep:
    """What the head reads of the target's step: its hidden states [tokens, hidden] and, per
    request (batch order), the index of its first kept token in them and its kept count."""

    hidden_states: torch.Tensor
    first_token: np.ndarray  # int
    num_kept: np.ndarray  # int


class EagleProposer:
    def __init__(self, draft: DraftModel, target: nn.Module, requests: RequestState,
                 block_tables: BlockTables, buffers: InputBuffers) -> None:
        self.head = draft.model
        self.kv_caches = draft.kv_caches
        self.target = target
        if self.head.embed_tokens is None and not hasattr(getattr(target, "model", None),
                                                          "embed"):
            raise ValueError(f"an EAGLE head without embeddings of its own needs a target of "
                             f"Llama's layout, not {type(target).__name__}")
        self.requests = requests
        self.block_tables = block_tables
        self.buffers = buffers  # the head's own step buffers (the target's hold its step)

    def propose(self, slots: np.ndarray, catch_up: np.ndarray, max_drafts: np.ndarray,
                step: TargetStep) -> np.ndarray:
        """Catch up the requests of `slots` (a step's, batch order) where `catch_up`, then
        draft up to `max_drafts` tokens each after their histories; returns their counts."""
        num_drafts = np.zeros(len(slots), np.int32)
        rows = np.flatnonzero(catch_up & (step.num_kept > 0))
        if not len(rows):
            return num_drafts
        count = step.num_kept[rows].astype(np.int32)
        order = decode_first_order(count > 1)
        rows, count = rows[order], count[order]
        tokens = np.repeat(step.first_token[rows], count) + run_offsets(count)
        # EAGLE-3: the streams the target output beside them, from the same forward.
        states = (self.target.model.aux_hidden_states if self.head.reads_layer_streams
                  else step.hidden_states)
        out = self._forward(slots[rows], count, -count,
                            self.head.target_features(states[torch.from_numpy(tokens)]))
        drafting = max_drafts[rows] > 0
        if not drafting.any():
            return num_drafts
        features = out[torch.from_numpy(np.cumsum(count)[drafting] - 1)]
        rows = rows[drafting]
        limit, row_slots = max_drafts[rows], slots[rows]
        starts = self.requests.total_len.numpy[row_slots]
        history = self.requests.token_ids.numpy
        for j in range(int(limit.max())):
            if j:  # the head at position num_computed + j - 1, fed draft j and its output
                more = limit > j
                rows, limit, row_slots, starts = (rows[more], limit[more], row_slots[more],
                                                  starts[more])
                features = self._forward(row_slots, np.ones(len(rows), np.int32),
                                         np.full(len(rows), j - 1, np.int32),
                                         features[torch.from_numpy(np.flatnonzero(more))])
            history[row_slots, starts + j] = self.head.next_tokens(features, self.target).numpy()
            num_drafts[rows] = j + 1
        return num_drafts

    def _forward(self, slots: np.ndarray, num_tokens: np.ndarray, offsets: np.ndarray,
                 features: torch.Tensor) -> torch.Tensor:
        """The head over `num_tokens` positions per request from `offsets` past its
        num_computed (rows in decode-first order), fed `features` (one per position, in
        order) and the tokens one past the positions -> its hidden states, in order."""
        batch = prepare_inputs([""] * len(slots), slots, num_tokens, self.requests,
                               self.block_tables, self.buffers, num_layers=len(self.kv_caches),
                               offsets=offsets)
        n = batch.num_tokens
        positions = batch.positions[:n]
        ids = self.requests.token_ids.numpy[np.repeat(slots, num_tokens), positions.numpy() + 1]
        input_ids = torch.from_numpy(ids.astype(np.int64))
        embeds = (self.head.embed_tokens(input_ids) if self.head.embed_tokens is not None
                  else self.target.model.embed(input_ids, positions)[1])
        return self.head(embeds, features, positions, self.kv_caches, batch.attn_metadata)
