"""Steady-state decode workload for timing the runner's host path, and the naive reference.

The reference is what a runner without persistent slot state does: rebuild every step input
from per-request Python lists and convert them with `torch.tensor`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from mrv2.async_output import AsyncOutput
from mrv2.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mrv2.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from mrv2.runner import ModelRunner
from mrv2.sampling_params import SamplingParams

PROMPT_LEN = 32
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048


def make_config(num_reqs: int) -> EngineConfig:
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, hidden_size=8,
                         vocab_size=1000)
    return EngineConfig(
        model_config=ModelConfig(model="none", dtype=torch.float32,
                                 max_model_len=MAX_MODEL_LEN, hf_config=hf),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=num_reqs,
                                         max_num_batched_tokens=max(num_reqs, PROMPT_LEN)))


class DecodeWorkload:
    """Scheduler outputs for `num_reqs` requests decoding one token per step."""

    def __init__(self, num_reqs: int) -> None:
        self.num_reqs = num_reqs
        self.req_ids = [f"r{i}" for i in range(num_reqs)]
        self.num_computed = PROMPT_LEN - 1
        blocks_per_req = MAX_MODEL_LEN // BLOCK_SIZE
        self.next_block = {r: 1 + i * blocks_per_req for i, r in enumerate(self.req_ids)}
        rng = np.random.default_rng(0)
        self.prompts = {r: rng.integers(0, 1000, PROMPT_LEN).tolist() for r in self.req_ids}

    def _take_blocks(self, req_id: str, n: int) -> list[int]:
        first = self.next_block[req_id]
        self.next_block[req_id] = first + n
        return list(range(first, first + n))

    def initial_output(self) -> SchedulerOutput:
        """Every request added with its prompt computed but the last token."""
        params = SamplingParams(temperature=0.0)
        num_blocks = -(-PROMPT_LEN // BLOCK_SIZE)
        new = [NewRequestData(r, self.prompts[r], self.prompts[r], params,
                              [self._take_blocks(r, num_blocks)], self.num_computed)
               for r in self.req_ids]
        return self._output(new, CachedRequestData())

    def next_output(self) -> SchedulerOutput:
        self.num_computed += 1
        # A new block for every request when its next token starts one.
        needs_block = self.num_computed % BLOCK_SIZE == 0
        # One KV cache group: per request, a list of one group's new block ids.
        new_blocks = [[self._take_blocks(r, 1) if needs_block else []] for r in self.req_ids]
        cached = CachedRequestData.build(self.req_ids, new_blocks,
                                         [self.num_computed] * self.num_reqs)
        return self._output([], cached)

    def _output(self, new: list[NewRequestData], cached: CachedRequestData) -> SchedulerOutput:
        return SchedulerOutput.build(new, cached, {r: 1 for r in self.req_ids}, self.num_reqs)


def runner_host_step(runner: ModelRunner, out: SchedulerOutput, sampled: torch.Tensor) -> None:
    """The runner's host path of one step: state update, staged apply, inputs, post_update."""
    cached_slots = runner._update_states(out)
    batch = runner._prepare_batch(out, cached_slots)[0]
    runner.requests.post_update(batch.idx_mapping, batch.num_scheduled, sampled)
    is_sampling = runner.requests.advance_num_computed_host(batch.idx_mapping_np,
                                                            batch.num_scheduled_np)
    AsyncOutput(batch.req_ids, sampled, is_sampling, copy_stream=None).get_output()


def make_runner(num_reqs: int) -> ModelRunner:
    return ModelRunner(make_config(num_reqs), model=None, kv_caches=[],
                       device=torch.device("cpu"))


class ListRebuildReference:
    """Per-request Python lists, rebuilt into tensors every step."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def step(self, out: SchedulerOutput, sampled: torch.Tensor) -> dict[str, torch.Tensor]:
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prefill_token_ids)
            (block_ids,) = new.block_ids  # the one KV cache group
            self.blocks[new.req_id] = list(block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, (block_ids,) in zip(cached.req_ids, cached.new_block_ids):
            self.blocks[req_id].extend(block_ids)
        input_ids, positions, slot_mapping, seq_lens, query_start_loc = [], [], [], [], [0]
        max_blocks = max(len(b) for b in self.blocks.values())
        tables = []
        for req_id, n in out.num_scheduled_tokens.items():
            start = self.computed[req_id]
            blocks = self.blocks[req_id]
            for pos in range(start, start + n):
                input_ids.append(self.tokens[req_id][pos])
                positions.append(pos)
                slot_mapping.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            seq_lens.append(start + n)
            query_start_loc.append(query_start_loc[-1] + n)
            tables.append(blocks + [0] * (max_blocks - len(blocks)))
        inputs = {
            "input_ids": torch.tensor(input_ids), "positions": torch.tensor(positions),
            "slot_mapping": torch.tensor(slot_mapping), "seq_lens": torch.tensor(seq_lens),
            "query_start_loc": torch.tensor(query_start_loc),
            "block_tables": torch.tensor(tables, dtype=torch.int32),
            "logits_indices": torch.tensor(query_start_loc[1:]) - 1,
        }
        for req_id, n, token in zip(out.num_scheduled_tokens, out.num_scheduled_tokens.values(),
                                    sampled.tolist()):
            self.computed[req_id] += n
            self.tokens[req_id].append(token)
        return inputs
