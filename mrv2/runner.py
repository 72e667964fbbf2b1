"""ModelRunner: the two phases of a step (DESIGN.md section 2).

Phase 1, `execute_model(scheduler_output)`: free finished slots, add new requests, stage
block-table deltas of running ones, apply all staged writes, prepare inputs, run the forward;
what phase 2 needs is kept in an `ExecuteState`. Phase 2, `sample_tokens(grammar_output)`:
logits of each row's last token (and of prompt positions for prompt logprobs), sampling, the
on-device post_update, then the one device-to-host copy of the sampled tokens. A step of
`num_decode_steps` > 1 (core/decode_steps.py) runs the further decode steps here. A pooling
engine also pools each row's final hidden states (state/pooling.py). Under pipeline stages
only the last samples; the others take its tokens (mrv2/pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from mrv2 import distributed, pipeline
from mrv2.async_output import AsyncOutput
from mrv2.attention.backend import AttentionMetadata
from mrv2.config import EngineConfig
from mrv2.cudagraph import BatchDescriptor, CudaGraphManager
from mrv2.inputs.batch import InputBatch
from mrv2.inputs.buffers import InputBuffers, max_step_rows
from mrv2.inputs.prepare import decode_first_order, prepare_inputs, repeat_offsets, verify_rows
from mrv2.models.generation_config import eos_token_ids
from mrv2.protocol import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from mrv2.runner_dummy import run_dummy_requests
from mrv2.sampler import Sampler, SamplerOutput, SamplingStates
from mrv2.sampler.grammar_bitmask import apply_grammar_bitmask_
from mrv2.sampler.prompt_logprobs import PromptLogprobsState
from mrv2.sampling_params import MAX_LOGPROBS, SamplingParams
from mrv2.state.block_table import BlockTables
from mrv2.state.host_staging import upload_array
from mrv2.state.pooling import PoolingState
from mrv2.spec_decode.verify import RequestRows, Speculator
from mrv2.state.requests import RequestState

if TYPE_CHECKING:  # the CPU's fused paths (numba) load with the model on a CPU worker
    from mrv2.models.cpu.decode import FusedDecode
    from mrv2.spec_decode.draft_model import DraftModel

EMPTY_OUTPUT = ModelRunnerOutput.build(req_ids=[], sampled_token_ids=[])


@dataclass
class ExecuteState:
    """What phase 1 leaves for phase 2 of the same step; no batch when nothing was scheduled."""

    batch: InputBatch | None
    hidden_states: torch.Tensor | None  # [num_tokens, hidden]
    # The sampled rows' float32 logits where the CPU's fused decode stack computed them with
    # the hidden states (every row sampled); None: phase 2 computes them.
    logits: torch.Tensor | None = None
    # Scheduler row -> batch row, where _prepare_batch moved rows; None when they are the same.
    batch_rows: np.ndarray | None = None
    num_steps: int = 1  # the decode steps phase 2 completes (SchedulerOutput.num_decode_steps)
    request_rows: RequestRows | None = None  # speculative decoding: the step's requests


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, kv_caches: list[torch.Tensor],
                 device: torch.device, draft: DraftModel | None = None) -> None:
        self.config = config
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        sched = config.scheduler_config
        model_config = config.model_config
        self.requests = RequestState(sched.max_num_seqs, model_config.max_model_len, device)
        layout = model_config.kv_cache_layout
        self.block_tables = BlockTables(sched.max_num_seqs, config.max_num_blocks_per_req,
                                        config.cache_config.block_size, device,
                                        layout.num_groups, layout.group_block_scales)
        self.sampling = SamplingStates(self.requests, model_config.vocab_size, model_config.seed,
                                       eos_token_ids(model_config.hf_config, model_config.model))
        self.buffers = InputBuffers(sched.max_num_batched_tokens, max_step_rows(config),
                                    config.max_num_blocks_per_req, device, layout.num_groups)
        self.sampler = Sampler(self.sampling, logprobs_mode=model_config.logprobs_mode)
        self.prompt_logprobs = PromptLogprobsState(model_config.vocab_size, device)
        # A pooling engine's runner also pools each request's hidden states (state/pooling.py).
        self.pooling = None
        if model_config.runner == "pooling":
            self.pooling = PoolingState(model_config.pooler_config, sched.max_num_seqs,
                                        model_config.hidden_size, device)
        self.speculator = (None if config.speculative_config is None  # spec_decode/verify.py
                           else Speculator(config, self.requests, self.sampling,
                                           self.block_tables, draft, model))
        self.cudagraphs = CudaGraphManager(config.compilation_config, sched.max_num_batched_tokens,
                                           sched.max_num_seqs, device)
        self._execute_state: ExecuteState | None = None
        self.stage_tokens = None if distributed.is_last_stage() else pipeline.StageTokens(
            config.max_steps_in_flight - 1)
        self.fused_decode: FusedDecode | None = None  # set by the worker: tried first each step
        self._copy_stream = (torch.cuda.Stream(device)  # the output copy, off the compute stream
                             if device.type == "cuda" else None)

    # ---- phase 1 -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self._execute_state is not None:
            raise RuntimeError("execute_model called twice without sample_tokens in between")
        if self.stage_tokens is not None:  # a stage before the last (mrv2/pipeline.py)
            self.stage_tokens.settle(self.requests, scheduler_output)
        cached_slots = self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Finished and preempted requests were processed; phase 2 has nothing to sample.
            self._execute_state = ExecuteState(batch=None, hidden_states=None)
            return
        batch, descriptor, batch_rows, request_rows = self._prepare_batch(scheduler_output,
                                                                         cached_slots)
        num_steps = scheduler_output.num_decode_steps
        if num_steps > 1 and batch.num_tokens != len(batch.req_ids):
            raise ValueError(f"a step of {num_steps} decode steps with prefill rows")
        hidden_states, logits = self._forward(batch, descriptor)
        self._execute_state = ExecuteState(batch=batch, hidden_states=hidden_states,
                                           logits=logits, batch_rows=batch_rows,
                                           num_steps=num_steps, request_rows=request_rows)

    def _forward(self, batch: InputBatch, descriptor: BatchDescriptor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states [num_tokens, hidden], the logits of every row where the fused
        decode paths computed them with the step, else None)."""
        if descriptor is not None:
            # Replay reads the persistent buffers prepare_inputs just filled (padded).
            return self.cudagraphs.replay(descriptor)[:batch.num_tokens], None
        n = batch.num_tokens
        args = (batch.input_ids[:n], batch.positions[:n], self.kv_caches, batch.attn_metadata)
        if self.fused_decode is not None:
            stepped = self.fused_decode.forward(*args)
            if stepped is not None:
                return stepped
        return self.model(*args), None

    def _update_states(self, out: SchedulerOutput) -> np.ndarray:
        """Apply the step's state changes; returns the slots of the cached (running) rows."""
        requests, tables = self.requests, self.block_tables
        for req_id in (*out.finished_req_ids, *out.preempted_req_ids):
            slot = requests.finish(req_id)
            if slot is not None:
                tables.clear_row(slot)
                if self.speculator is not None:
                    self.speculator.finish(slot)
            if self.prompt_logprobs:
                self.prompt_logprobs.finish(req_id)
        for new in out.scheduled_new_reqs:
            slot = requests.add(new.req_id, len(new.prompt_token_ids), new.prefill_token_ids,
                                new.num_computed_tokens)
            for group, block_ids in enumerate(new.block_ids):
                tables.append_block_ids(slot, block_ids, overwrite=True, group=group)
            self.sampling.add(slot, new.req_id, new.sampling_params, new.prompt_token_ids,
                              new.prefill_token_ids, eos_token_id=new.eos_token_id,
                              eos_stop_token_ids=new.eos_stop_token_ids)
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_logprobs.add(new.req_id, new.prompt_token_ids,
                                         len(new.prefill_token_ids),
                                         new.sampling_params.prompt_logprobs)
            if self.pooling is not None:
                self.pooling.add(slot)
            if self.speculator is not None:
                self.speculator.add(slot, new.sampling_params)
        cached = out.scheduled_cached_reqs
        slots = requests.slots_of(cached.req_ids)
        if cached.num_reqs:
            tables.append_block_id_runs(slots, cached.num_new_blocks, cached.new_block_ids_flat)
            requests.set_num_computed_host(slots, cached.num_computed_tokens)
        requests.apply_staged_writes()
        tables.apply_staged_writes()
        self.sampling.apply_staged_writes()
        if self.pooling is not None:
            self.pooling.apply_staged_writes()
        return slots

    def _prepare_batch(self, out: SchedulerOutput, cached_slots: np.ndarray
                       ) -> tuple[InputBatch, BatchDescriptor | None, np.ndarray | None,
                                  RequestRows | None]:
        req_ids = out.req_ids
        num_scheduled = out.num_scheduled.copy()  # the message's view is read-only
        num_cached = len(cached_slots)
        # The scheduler sends running (cached) rows first: their slots are known already.
        if out.cached_rows_first:
            slots = np.concatenate([cached_slots,
                                    self.requests.slots_of(req_ids[num_cached:])])
        else:
            slots = self.requests.slots_of(req_ids)
        is_verify = (None if self.speculator is None  # verify rows: decode rows, first with them
                     else self.speculator.begin_step(slots, num_scheduled, out.draft_threshold))
        is_prefill = num_scheduled > 1 if is_verify is None else (num_scheduled > 1) & ~is_verify
        batch_rows = None
        if (is_prefill[:-1] & ~is_prefill[1:]).any():  # not decode-first yet
            order = decode_first_order(is_prefill)
            req_ids = [req_ids[i] for i in order]
            slots, num_scheduled = slots[order], num_scheduled[order]
            is_verify = None if is_verify is None else is_verify[order]
            batch_rows = np.empty_like(order)
            batch_rows[order] = np.arange(len(order))
        if is_verify is None:
            batch, descriptor = self._inputs(req_ids, slots, num_scheduled,
                                             out.total_num_scheduled_tokens)
            return batch, descriptor, batch_rows, None
        row_req_ids, row_slots, row_scheduled, offsets, first_row = verify_rows(
            req_ids, slots, num_scheduled, is_verify)
        rows = RequestRows(req_ids, slots, num_scheduled, is_verify, first_row)
        # A scheduler row's grammar masks apply from its request's first batch row on.
        first_rows = rows.first_row
        batch_rows = first_rows if batch_rows is None else first_rows[batch_rows]
        batch, descriptor = self._inputs(row_req_ids, row_slots, row_scheduled,
                                         out.total_num_scheduled_tokens, offsets,
                                         int((~is_prefill).sum()))
        return batch, descriptor, batch_rows, rows

    def _inputs(self, req_ids: list[str], slots: np.ndarray, num_scheduled: np.ndarray,
                num_tokens: int, offsets: np.ndarray | None = None,
                num_decode_sequences: int | None = None
                ) -> tuple[InputBatch, BatchDescriptor | None]:
        """The step's inputs from the slots' state (rows in decode-first order), padded for
        its graph where one is captured."""
        tokens_padded, reqs_padded, descriptor = self.cudagraphs.padded_sizes(
            num_tokens, len(req_ids), uniform_decode=num_tokens == len(req_ids))
        batch = prepare_inputs(req_ids, slots, num_scheduled, self.requests, self.block_tables,
                               self.buffers, num_tokens_padded=tokens_padded,
                               num_reqs_padded=reqs_padded, num_layers=len(self.kv_caches),
                               offsets=offsets, num_decode_sequences=num_decode_sequences)
        return batch, descriptor

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture one graph per descriptor, reading only the persistent step buffers. Host-side
        metadata is fixed per descriptor: a graph cannot depend on one batch's shapes. Needs
        an attention backend that reads only device tensors."""
        if not self.cudagraphs.descriptors:
            return
        buffers, max_len = self.buffers, self.config.model_config.max_model_len

        def run(desc: BatchDescriptor) -> torch.Tensor:
            n, r = desc.num_tokens, desc.num_reqs
            meta = AttentionMetadata(
                num_actual_tokens=n, num_reqs=r, num_decodes=r if desc.uniform_decode else 0,
                query_start_loc=buffers.query_start_loc[:r + 1], seq_lens=buffers.seq_lens[:r],
                block_tables=buffers.block_tables[0, :r], slot_mapping=buffers.slot_mapping[0, :n],
                query_start_loc_np=np.zeros(r + 1, np.int32),
                seq_lens_np=np.zeros(r, np.int32), max_seq_len=max_len)
            meta.other_groups = tuple(
                replace(meta, block_tables=tables[:r], slot_mapping=slots[:n])
                for tables, slots in zip(buffers.block_tables[1:], buffers.slot_mapping[1:]))
            return self.model(buffers.input_ids[:n], buffers.positions[:n], self.kv_caches,
                              meta)

        self.cudagraphs.capture(run)

    def warm_up(self) -> None:
        """Run every kernel family once (no numba / Triton compile while a user waits): two
        dummy requests through both phases, one greedy, one with each lazily-free sampling
        feature. Not penalties: their count table is allocated only when a request uses them."""
        featured = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.01, seed=0,
                                  logit_bias={0: 0.5}, allowed_token_ids=[0, 1, 2],
                                  min_tokens=2, stop_token_ids=[0], logprobs=2,
                                  prompt_logprobs=1)
        params = ([featured] if self.config.scheduler_config.max_num_seqs == 1
                  else [SamplingParams(temperature=0.0), featured])
        # Two blocks and a bit: a prefill crossing block boundaries.
        run_dummy_requests(self, params, 2 * self.block_tables.block_size + 1, decode=True)

    def profile_run(self) -> None:
        """The largest step a batch can make, once (max_num_batched_tokens prompt tokens over
        as few requests as fit, with penalties and MAX_LOGPROBS logprobs), so the worker can
        measure a step's peak memory before it sizes the KV cache."""
        sched = self.config.scheduler_config
        max_len = self.config.model_config.max_model_len
        num_reqs = min(sched.max_num_seqs, -(-sched.max_num_batched_tokens // max(1, max_len - 1)))
        widest = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0,
                                repetition_penalty=1.1, frequency_penalty=0.1,
                                logprobs=MAX_LOGPROBS)
        run_dummy_requests(self, [widest] * num_reqs,
                                 sched.max_num_batched_tokens // num_reqs, decode=False)

    # ---- phase 2 -------------------------------------------------------------------------
    def _apply_grammar(self, logits: torch.Tensor, grammar_output: GrammarOutput,
                       batch_rows: np.ndarray | None) -> torch.Tensor:
        """-inf on every token a row's grammar forbids next (float32 logits, masked in place:
        the sampler copies them anyway)."""
        rows = grammar_output.rows.astype(np.int64)
        if batch_rows is not None:  # a row repeated in a run: its verify rows, in order
            rows = batch_rows[rows] + repeat_offsets(rows)
        logits = logits.float()
        # The message's buffer is read-only; torch wants a writable array.
        apply_grammar_bitmask_(logits, upload_array(rows, self.device),
                               upload_array(grammar_output.bitmask.copy(), self.device))
        return logits

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Phase 2; returns once the step's output copy has landed on the host."""
        output = self.sample_tokens_async(grammar_output)
        return output if isinstance(output, ModelRunnerOutput) else output.get_output()

    @torch.inference_mode()
    def sample_tokens_async(self, grammar_output: GrammarOutput | None = None
                            ) -> AsyncOutput | ModelRunnerOutput:
        """Phase 2, not waiting for the output copy (the executor resolves the AsyncOutput)."""
        state, self._execute_state = self._execute_state, None
        if state is None:
            raise RuntimeError("sample_tokens called without a pending execute_model")
        if state.batch is None:
            return EMPTY_OUTPUT
        batch = state.batch
        if self.stage_tokens is not None:  # the last stage samples (mrv2/pipeline.py)
            self.stage_tokens.follow(self.requests, batch)
            return EMPTY_OUTPUT
        # A step of one token per row samples every row: its hidden states go on whole.
        last_hidden = (state.hidden_states if batch.num_tokens == len(batch.req_ids)
                       else state.hidden_states[batch.logits_indices])
        logits = (self.model.compute_logits(last_hidden) if state.logits is None
                  else state.logits)
        if grammar_output is not None and grammar_output.num_rows:
            logits = self._apply_grammar(logits, grammar_output, state.batch_rows)
        idx = batch.idx_mapping
        # The position of the token being sampled keys its noise (invariant 7) and counts the
        # outputs so far (min_tokens): one past the row's last token, its sequence length.
        positions = batch.attn_metadata.seq_lens[:len(batch.req_ids)]
        rows = state.request_rows  # speculative decoding: drafts count for penalties
        out = self.sampler(logits, idx, batch.idx_mapping_np, positions,
                           None if rows is None else self.speculator.drafts_before(batch, rows))
        pipeline.share_sampled(out.sampled)
        prompt_logprobs = None
        if self.prompt_logprobs:  # only while some request still needs prompt rows
            # num_computed_host still holds each row's count before this step (the start).
            prompt_logprobs = self.prompt_logprobs.compute(
                batch.req_ids, self.requests.num_computed_host[batch.idx_mapping_np],
                batch.num_scheduled_np, batch.attn_metadata.query_start_loc_np,
                state.hidden_states, self.model.compute_logits)
        max_rows = None if self.fused_decode is None else self.fused_decode.verify_rows
        if rows is not None and state.num_steps == 1:  # speculative decoding: per request
            return self.speculator.sample_output(batch, rows, out, positions, state.hidden_states,
                                                 self._copy_stream, prompt_logprobs, max_rows)
        pooled = None
        if self.pooling is not None:  # read by the output copy for the finishing rows
            pooled = self.pooling.pool(state.hidden_states, last_hidden, batch,
                                       self.requests.prompt_len.tensor)
        self.requests.post_update(idx, batch.num_scheduled, out.sampled)
        self.sampling.post_update(idx, batch.idx_mapping_np, positions, out.sampled)
        # A row samples once its prefill is complete; the host knows this from its mirrors.
        is_sampling = self.requests.advance_num_computed_host(batch.idx_mapping_np,
                                                              batch.num_scheduled_np)
        sampled, nan_rows, run_hidden = out.sampled, out.nan_rows, None
        if state.num_steps > 1:
            sampled, nan_rows, run_hidden = self._decode_steps(batch, out, state.num_steps)
        num_logprobs = (None if out.logprobs is None
                        else self.sampling.num_logprobs(batch.idx_mapping_np))
        drafts = None if rows is None else self.speculator.propose_after_run(
            batch.idx_mapping_np, state.num_steps, max_rows, run_hidden)
        return AsyncOutput(batch.req_ids, sampled, is_sampling, self._copy_stream,
                           logprobs=out.logprobs, num_logprobs=num_logprobs,
                           prompt_logprobs=prompt_logprobs, nan_rows=nan_rows,
                           pooled=pooled, drafts=drafts)

    def _decode_steps(self, batch: InputBatch, first: SamplerOutput, num_steps: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After a decode step's sampling and post_update: `num_steps` - 1 more decode steps of
        the same rows, each fed the token the last one sampled. Returns the tokens [rows,
        num_steps], the rows whose logits held a NaN at any step and the last step's hidden
        states. Every row decodes by argmax (the scheduler's rule): no grammar, no logprobs."""
        flags = self.sampling.batch_flags(batch.idx_mapping_np)
        if not flags.all_greedy or flags.any_processing or flags.max_num_logprobs >= 0:
            raise ValueError(f"{num_steps} decode steps for rows that do not decode by argmax")
        def next_inputs() -> tuple[InputBatch, BatchDescriptor | None]:  # post_update's state
            return self._inputs(batch.req_ids, batch.idx_mapping_np, batch.num_scheduled_np,
                                batch.num_tokens)

        step, descriptor = next_inputs()
        run = (None if descriptor is not None or self.fused_decode is None
               else self.fused_decode.run_steps(step.input_ids[:step.num_tokens],
                                    step.positions[:step.num_tokens], self.kv_caches,
                                    step.attn_metadata, num_steps, self.block_tables.block_size,
                                    self.sampling.run_stops.rows(step.idx_mapping_np)))
        if run is not None:  # the whole run in one call: the state catches up
            # (sampling.post_update counts tokens for penalties: argmax rows have none)
            self.requests.post_update_steps(step.idx_mapping, run[0][:, 1:])
            self.requests.advance_num_computed_host(step.idx_mapping_np,
                                                    step.num_scheduled_np * (num_steps - 1))
            return run[0], run[1] | first.nan_rows, run[2]
        columns, nans = [first.sampled], [first.nan_rows]
        while True:
            hidden, logits = self._forward(step, descriptor)
            if logits is None:
                logits = self.model.compute_logits(hidden)
            positions = step.attn_metadata.seq_lens[:len(step.req_ids)]
            out = self.sampler.argmax(logits, step.idx_mapping, step.idx_mapping_np, positions)
            self.requests.post_update(step.idx_mapping, step.num_scheduled, out.sampled)
            self.sampling.post_update(step.idx_mapping, step.idx_mapping_np, positions,
                                      out.sampled)
            self.requests.advance_num_computed_host(step.idx_mapping_np, step.num_scheduled_np)
            columns.append(out.sampled)
            nans.append(out.nan_rows)
            if len(columns) == num_steps:
                return torch.stack(columns, dim=1), torch.stack(nans, dim=1).any(dim=1), hidden
            step, descriptor = next_inputs()
