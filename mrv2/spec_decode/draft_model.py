"""Draft-model speculation: a smaller model sharing the target's vocabulary proposes each
request's next tokens greedily, with a KV cache of its own (speculative_config method
"draft_model").

The draft's cache has the target's block count and block size and is indexed by the target's
block tables: a request's draft KV lies in the same block ids as its target KV, so the
scheduler's allocation (with `SpeculativeConfig.num_lookahead_tokens` slots past each step's
tokens, for the drafts' KV) and the prefix cache serve both. A block shared through the prefix
cache may hold draft KV another request never computed; so a request's draft KV counts as
valid only up to what this request's own draft forwards wrote (`end_host`), from position 0.

Per step (phase 2, after the target's tokens are kept), `DraftModelProposer.propose`, for the
requests that draft this step (none while one backs off: drafts.py):
1. Catch-up: the draft runs over the request's tokens it has not seen (its prompt, at its first
   drafts; after a verify step, the token sampled at the first rejected draft, or the last
   accepted draft and the bonus token; after a backoff, the tokens since), within its step
   buffers' token budget (a request cut short drafts at a later step).
2. The logits of each request's last token give its first draft (argmax); each further draft
   is one decode forward fed the draft before it (the fused stack's argmax run, one call).
The drafts go into the request's token history after its last token (DraftState's place), from
which each forward's inputs are read (inputs/prepare.py, with per-row offsets). A draft forward
writes KV after the request's known tokens: `end_host` records how far it wrote, and the next
step keeps only what the target confirmed (positions before its first unverified token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from mrv2.attention.backend import kv_cache_shape
from mrv2.config import ModelConfig
from mrv2.core.kv_cache_layout import layer_kv_shape
from mrv2.inputs.batch import InputBatch
from mrv2.inputs.buffers import InputBuffers
from mrv2.inputs.prepare import decode_first_order, prepare_inputs, run_offsets
from mrv2.state.block_table import BlockTables
from mrv2.state.requests import RequestState
from mrv2.utils import huge_pages

if TYPE_CHECKING:
    from mrv2.models.cpu.decode import FusedDecode


def draft_kv_block_bytes(draft: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block id in the draft's KV cache (every layer's K and V)."""
    hf = draft.hf_config
    return sum(2 * block_size * heads * dim * dtype.itemsize
               for heads, dim in (layer_kv_shape(hf, i) for i in range(draft.num_layers)))


def draft_kv_caches(draft: ModelConfig, num_blocks: int, block_size: int,
                    dtype: torch.dtype) -> list[torch.Tensor]:
    """Each draft layer's KV cache [2, blocks, block_size, kv heads, head dim], zeroed."""
    return [huge_pages.zeros(kv_cache_shape(num_blocks, block_size,
                                            *layer_kv_shape(draft.hf_config, i)), dtype)
            for i in range(draft.num_layers)]


@dataclass
class DraftModel:
    """What the worker loads for method "draft_model": the model, its fused decode paths (the
    CPU's, or None) and its KV caches."""

    model: nn.Module
    fused_decode: FusedDecode | None
    kv_caches: list[torch.Tensor]


class DraftModelProposer:
    def __init__(self, draft: DraftModel, requests: RequestState, block_tables: BlockTables,
                 buffers: InputBuffers, split_tokens: int) -> None:
        self.draft = draft
        # Catch-ups of at most this many tokens run a decode row per token (`_forward`).
        self.split_tokens = split_tokens
        self.requests = requests
        self.block_tables = block_tables
        self.buffers = buffers  # the draft's own step buffers (the target's hold its step)
        # Per slot: positions 0 .. end - 1 hold KV the draft computed for this request (its
        # known tokens, then its latest drafts).
        self.end_host = np.zeros(requests.max_num_seqs, dtype=np.int32)

    def start(self, slot: int) -> None:
        self.end_host[slot] = 0

    def propose(self, slots: np.ndarray, max_drafts: np.ndarray) -> np.ndarray:
        """Drafts for `slots` (requests that just sampled: up to `max_drafts` each), written
        after their histories; returns their counts (int32)."""
        requests = self.requests
        total_len, computed = requests.total_len.numpy, requests.num_computed_host
        num_drafts = np.zeros(len(slots), np.int32)
        rows = np.flatnonzero(max_drafts > 0)  # only they catch up: none while backing off
        if not len(rows):
            return num_drafts
        row_slots = slots[rows]
        # What the draft keeps: its KV of tokens the target has confirmed since.
        valid = np.minimum(self.end_host[row_slots], computed[row_slots])
        # Catch-up within the buffers' tokens, first rows first; a row cut short drafts later.
        lag = total_len[row_slots] - valid
        room = np.maximum(self.buffers.max_num_tokens - (np.cumsum(lag) - lag), 0)
        run = np.minimum(lag, room).astype(np.int32)
        self.end_host[row_slots] = valid + run
        caught_up = run == lag
        ran = run > 0
        if not ran.any():
            return num_drafts
        tokens = self._forward(row_slots[ran], run[ran], (valid - computed[row_slots])[ran],
                               caught_up[ran])
        rows, row_slots = rows[caught_up], row_slots[caught_up]
        starts = total_len[row_slots]
        self._record(row_slots, rows, starts, 0, tokens, num_drafts)
        self._chain(rows, row_slots, starts, max_drafts[rows], num_drafts)
        return num_drafts

    def _chain(self, rows: np.ndarray, row_slots: np.ndarray, starts: np.ndarray,
               max_drafts: np.ndarray, num_drafts: np.ndarray) -> None:
        """Drafts 2 .. max_drafts of requests with their first: each one decode forward fed
        the draft before, at its position (nc + j: nc = total_len - 1); all in one call of
        the fused stack where it takes the rows and they draft as many (its argmax run)."""
        steps = int(max_drafts.max(initial=0))
        fused = self.draft.fused_decode
        if steps > 1 and fused is not None and (max_drafts == steps).all():
            batch = self._prepare(row_slots, np.ones(len(rows), np.int32),
                                  np.ones(len(rows), np.int32))
            n = batch.num_tokens
            run = fused.run_steps(batch.input_ids[:n], batch.positions[:n], self.draft.kv_caches,
                                  batch.attn_metadata, steps, self.block_tables.block_size)
            if run is not None:  # its column 0 is the first draft, fed
                tokens = run[0].numpy().astype(np.int32)
                for j in range(1, steps):
                    self._record(row_slots, rows, starts, j, tokens[:, j], num_drafts)
                self.end_host[row_slots] = starts + steps - 1
                return
        for j in range(1, steps):
            more = max_drafts > j
            rows, row_slots, starts, max_drafts = (rows[more], row_slots[more], starts[more],
                                                   max_drafts[more])
            tokens = self._forward(row_slots, np.ones(len(rows), np.int32),
                                   np.full(len(rows), j, np.int32), np.ones(len(rows), np.bool_))
            self.end_host[row_slots] = starts + j
            self._record(row_slots, rows, starts, j, tokens, num_drafts)

    def _record(self, draft_slots: np.ndarray, rows: np.ndarray, starts: np.ndarray, j: int,
                tokens: np.ndarray, num_drafts: np.ndarray) -> None:
        """Draft j of these requests (`rows` of the proposal) after their history, where the
        next draft forward and the verify step read it."""
        self.requests.token_ids.numpy[draft_slots, starts + j] = tokens
        num_drafts[rows] = j + 1

    def _prepare(self, slots: np.ndarray, num_tokens: np.ndarray, offsets: np.ndarray
                 ) -> InputBatch:
        """A draft forward's inputs (rows in decode-first order) in the draft's buffers."""
        return prepare_inputs([""] * len(slots), slots, num_tokens, self.requests,
                              self.block_tables, self.buffers,
                              num_layers=len(self.draft.kv_caches), offsets=offsets)

    def _forward(self, slots: np.ndarray, num_tokens: np.ndarray, offsets: np.ndarray,
                 wanted_rows: np.ndarray) -> np.ndarray:
        """One draft forward of `num_tokens` tokens per request, from `offsets` past its
        num_computed; returns the argmax token after each of `wanted_rows`' last token (int32,
        in row order). A request of at most `split_tokens` tokens runs as a decode row per
        token (as a verify row does), which the fused stack takes; a longer one as a prefill."""
        split = num_tokens <= self.split_tokens
        reps = np.where(split, num_tokens, 1)
        row_of = np.repeat(np.arange(len(slots)), reps)
        within = run_offsets(reps)
        slots, offsets = slots[row_of], offsets[row_of] + within
        num_tokens = np.where(split[row_of], 1, num_tokens[row_of]).astype(np.int32)
        wanted_rows = wanted_rows[row_of] & (within == reps[row_of] - 1)
        order = decode_first_order(num_tokens > 1)
        batch = self._prepare(slots[order], num_tokens[order], offsets[order])
        n = batch.num_tokens
        args = (batch.input_ids[:n], batch.positions[:n], self.draft.kv_caches,
                batch.attn_metadata)
        stepped = (None if self.draft.fused_decode is None
                   else self.draft.fused_decode.forward(*args))
        hidden, logits = stepped if stepped is not None else (self.draft.model(*args), None)
        wanted = np.flatnonzero(wanted_rows[order])
        if logits is None:
            index = batch.logits_indices[torch.from_numpy(wanted)]
            logits = self.draft.model.compute_logits(hidden[index])
        else:
            logits = logits[torch.from_numpy(wanted)]
        tokens = torch.argmax(logits, dim=-1).numpy().astype(np.int32)
        # Back to row order (a request's wanted row is its last).
        out = np.empty(len(order), np.int32)
        out[order[wanted]] = tokens
        return out[wanted_rows]


def load_draft_model(config: ModelConfig, device: torch.device, method: str = "draft_model"
                     ) -> tuple[nn.Module, FusedDecode | None]:
    """The draft model (or, method "eagle" / "eagle3", the EAGLE head: models/eagle.py,
    models/eagle3.py) loaded as the target is (its weights packed as its config asks) and, on
    the CPU, its fused decode paths (none for a head)."""
    from mrv2.models import cpu as cpu_fast_paths
    from mrv2.models.eagle import EagleLlamaForCausalLM
    from mrv2.models.eagle3 import Eagle3LlamaForCausalLM
    from mrv2.models.loader import load_model

    heads = {"eagle": EagleLlamaForCausalLM, "eagle3": Eagle3LlamaForCausalLM}
    model = load_model(config, device, heads.get(method))
    if device.type != "cpu":
        return model, None
    return model, cpu_fast_paths.prepare(model, config).decode
