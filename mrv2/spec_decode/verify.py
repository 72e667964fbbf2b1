"""Speculator: speculative decoding's part of a runner step (runner.py calls it).

Phase 1: a request scheduled for more tokens than its last sampled one, past its prefill, is a
verify row: its sampled token and its drafts (already in its token history: drafts.py). It is
split into one decode row per token (inputs/prepare.verify_rows), so the model's decode
paths (the CPU's fused stack included) verify every draft in the one forward and the sampler
samples every row. Phase 2, per request: the drafts the sampled tokens confirm
(sampler/rejection.py), the state advanced by the tokens kept (the sampled token plus the
accepted drafts; rejected drafts' KV is written over later), new drafts proposed, and the
request's tokens [accepted + 1] in the step's output with its count of new drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mrv2 import platform
from mrv2.async_output import AsyncOutput
from mrv2.inputs.batch import InputBatch
from mrv2.sampler.logprobs import LogprobsTensors
from mrv2.sampler.rejection import verify_drafts
from mrv2.sampler.sampler import SamplerOutput
from mrv2.sampler.states import SamplingStates
from mrv2.sampling_params import SamplingParams
from mrv2.config import EngineConfig
from mrv2.inputs.buffers import InputBuffers, max_step_rows
from mrv2.inputs.prepare import run_offsets
from mrv2.spec_decode.config import EAGLE_METHODS
from mrv2.spec_decode.draft_model import DraftModel, DraftModelProposer
from mrv2.spec_decode.drafts import DraftState
from mrv2.spec_decode.eagle import EagleProposer, TargetStep
from mrv2.state.block_table import BlockTables
from mrv2.state.requests import RequestState


@dataclass
class RequestRows:
    """A step's requests, batch order, where verify rows were split into a row per token."""

    req_ids: list[str]
    slots: np.ndarray  # int64
    num_scheduled: np.ndarray  # int32: 1 + drafts for a verify row
    is_verify: np.ndarray  # bool
    first_row: np.ndarray  # int64: the request's first batch row

    @property
    def num_rows(self) -> np.ndarray:
        return np.where(self.is_verify, self.num_scheduled, 1)


class Speculator:
    def __init__(self, config: EngineConfig, requests: RequestState, sampling: SamplingStates,
                 block_tables: BlockTables, draft: DraftModel | None = None,
                 target: nn.Module | None = None) -> None:
        self.requests = requests
        self.sampling = sampling
        spec = config.speculative_config
        proposer = eagle = None
        if spec.model is not None:
            if draft is None:
                raise ValueError(f"speculative method {spec.method!r} without its loaded model")
            # Its own step buffers: the target's hold this step's batch until it is output.
            buffers = InputBuffers(config.scheduler_config.max_num_batched_tokens,
                                   max_step_rows(config), config.max_num_blocks_per_req,
                                   requests.device, block_tables.num_groups)
            if spec.method in EAGLE_METHODS:
                eagle = EagleProposer(draft, target, requests, block_tables, buffers)
            else:
                proposer = DraftModelProposer(draft, requests, block_tables, buffers,
                                              split_tokens=spec.num_speculative_tokens + 1)
        self.draft_kv_caches = [] if draft is None else draft.kv_caches
        self.drafts = DraftState(spec, requests, proposer, eagle)

    def add(self, slot: int, params: SamplingParams) -> None:
        self.drafts.add(slot, params)

    def finish(self, slot: int) -> None:
        self.drafts.finish(slot)

    def begin_step(self, slots: np.ndarray, num_scheduled: np.ndarray,
                   draft_threshold: float) -> np.ndarray:
        """Phase 1 of a step begins, with the scheduler's draft threshold for the step's
        proposals (SchedulerOutput.draft_threshold): which of its rows verify drafts (more
        than one token, past the prefill)."""
        self.drafts.threshold = draft_threshold
        requests = self.requests
        return (num_scheduled > 1) & (requests.num_computed_host[slots]
                                      >= requests.prefill_len_host[slots])

    def drafts_before(self, batch: InputBatch, rows: RequestRows) -> torch.Tensor | None:
        """The sampler's `drafts_before` ([batch rows, k], -1 padded): for each verify row,
        the drafts of its request fed by the rows before it, which count as outputs for its
        penalties; None when no request verifying drafts uses penalties (most steps)."""
        verifying = rows.slots[rows.is_verify]
        if not len(verifying) or not self.sampling.uses_penalties(verifying):
            return None
        num_rows = rows.num_rows
        first = np.repeat(rows.first_row, num_rows)
        before = np.arange(len(first)) - first  # drafts before each row: its place in its run
        cols = np.arange(self.drafts.num_speculative_tokens)
        valid = cols[None, :] < before[:, None]
        fed = batch.input_ids.numpy()[np.where(valid, first[:, None] + 1 + cols[None, :], 0)]
        return torch.from_numpy(np.where(valid, fed, -1).astype(np.int64)).to(
            batch.input_ids.device)

    def propose_after_run(self, slots: np.ndarray, steps: int, max_rows: int | None,
                          hidden_states: torch.Tensor
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The drafts of a multi-step run's requests (none held drafts: core/decode_steps.py),
        their histories advanced by the run, for the run's output (DraftState.written); an
        EAGLE head catches up on the run's last position (`hidden_states`: the last step's,
        a row each)."""
        if self.drafts.eagle is None:
            return self.drafts.written(slots, self.drafts.propose(slots, max_rows, steps))
        rows = len(slots)
        step = TargetStep(hidden_states, np.arange(rows), np.ones(rows, np.int32))
        return self.drafts.written(slots, self.drafts.propose_from_hidden(
            slots, np.ones(rows, np.bool_), max_rows, step, steps))

    def sample_output(self, batch: InputBatch, rows: RequestRows, out: SamplerOutput,
                      positions: torch.Tensor, hidden_states: torch.Tensor,
                      copy_stream: torch.cuda.Stream | None, prompt_logprobs: dict | None,
                      max_rows: int | None) -> AsyncOutput:
        """After the sampler: advance each request by the tokens it keeps, propose its next
        drafts (within `max_rows` rows a step: DraftState.propose; an EAGLE head reads the
        step's `hidden_states`), and return the step's output (per request, batch order)."""
        num_rows = rows.num_rows
        # Verify rows come first (decode first), one token each: their row is their token.
        if platform.kernel_impl(out.sampled.device) == platform.CPU:
            from mrv2.sampler import rejection_numba

            num_accepted, final_rows, nan = rejection_numba.verify_drafts(
                out.sampled.numpy(), batch.input_ids.numpy(), rows.first_row, num_rows,
                out.nan_rows.numpy())
        else:  # the host needs the counts for the output's shape: one sync here
            accepted, final, nan_t = verify_drafts(
                out.sampled, batch.input_ids, torch.from_numpy(rows.first_row).to(
                    out.sampled.device), torch.from_numpy(num_rows).to(out.sampled.device),
                out.nan_rows)
            num_accepted, final_rows, nan = accepted.cpu().numpy(), final.cpu().numpy(), nan_t
        device = out.sampled.device
        final_index = torch.from_numpy(final_rows).to(device)
        slots = torch.from_numpy(rows.slots).to(device)
        kept = np.where(rows.is_verify, 1 + num_accepted, rows.num_scheduled).astype(np.int32)
        final_tokens = out.sampled[final_index]
        self.requests.post_update(slots, torch.from_numpy(kept).to(device), final_tokens)
        # Every kept token (the accepted drafts are each the token sampled at the row before
        # them) counts for the penalties; a prefill row's one row samples nothing yet.
        num_kept_rows = np.where(rows.is_verify, 1 + num_accepted, 1)
        kept_rows = (np.repeat(final_rows - num_kept_rows + 1, num_kept_rows)
                     + run_offsets(num_kept_rows))
        kept_index = torch.from_numpy(kept_rows).to(device)
        kept_slots = np.repeat(rows.slots, num_kept_rows)
        self.sampling.post_update(torch.from_numpy(kept_slots).to(device), kept_slots,
                                  positions[kept_index], out.sampled[kept_index])
        is_sampling = self.requests.advance_num_computed_host(rows.slots, kept)
        verified = rows.is_verify
        self.drafts.record_verified(rows.slots[verified], rows.num_scheduled[verified] - 1,
                                    num_accepted[verified])
        if self.drafts.eagle is not None:  # every request's kept tokens feed its head
            num_drafts = self.drafts.propose_from_hidden(rows.slots, is_sampling, max_rows,
                TargetStep(hidden_states, batch.attn_metadata.query_start_loc_np[rows.first_row],
                           kept))
        else:
            num_drafts = np.zeros(len(rows.slots), np.int32)
            num_drafts[is_sampling] = self.drafts.propose(rows.slots[is_sampling], max_rows)
        # Each request's tokens: its rows' sampled tokens up to the last kept one.
        width = self.drafts.num_speculative_tokens + 1
        cols = np.minimum(rows.first_row[:, None] + np.arange(width), len(batch.req_ids) - 1)
        tokens = out.sampled[torch.from_numpy(cols).to(device)]
        num_sampled = np.where(is_sampling, num_accepted + 1, 0)
        logprobs = out.logprobs
        if logprobs is not None:  # the kept rows', request after request
            index = kept_index[torch.from_numpy(np.repeat(is_sampling, num_kept_rows)).to(device)]
            logprobs = LogprobsTensors(logprobs.token_ids[index], logprobs.logprobs[index],
                                       logprobs.ranks[index])
        return AsyncOutput(rows.req_ids, tokens, is_sampling, copy_stream, logprobs=logprobs,
                           num_logprobs=(None if logprobs is None
                                         else self.sampling.num_logprobs(rows.slots)),
                           prompt_logprobs=prompt_logprobs,
                           nan_rows=torch.as_tensor(nan, device=device),
                           num_sampled=num_sampled,
                           drafts=self.drafts.written(rows.slots, num_drafts))
