"""Property test: random add / chunked prefill / decode / finish / preempt / resume sequences
drive the runner; after every step its prepared inputs equal a reference rebuilt from plain
Python lists (issue 3). The model is a recorder whose logits make the sampled token a known
function of the position, so the reference can follow the token history too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mrv2.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mrv2.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from mrv2.runner import ModelRunner
from mrv2.sampling_params import SamplingParams

VOCAB, BLOCK, MAX_LEN, MAX_SEQS, MAX_TOKENS = 97, 4, 64, 4, 24
GREEDY = SamplingParams(temperature=0.0)


def token_after(position: int) -> int:
    """The token the recorder model makes the runner sample after `position`."""
    return (position * 7 + 3) % VOCAB


class RecorderModel:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, input_ids, positions, kv_caches, meta):
        r = meta.num_reqs
        self.calls.append({
            "input_ids": input_ids[:meta.num_actual_tokens].tolist(),
            "positions": positions[:meta.num_actual_tokens].tolist(),
            "query_start_loc": meta.query_start_loc[:r + 1].tolist(),
            "seq_lens": meta.seq_lens[:r].tolist(),
            "seq_lens_np": meta.seq_lens_np[:r].tolist(),
            "slot_mapping": meta.slot_mapping[:meta.num_actual_tokens].tolist(),
            "block_tables": meta.block_tables[:r].tolist(),
            "num_decodes": meta.num_decodes,
        })
        return positions.to(torch.float32)[:, None]

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], VOCAB)
        logits[torch.arange(hidden.shape[0]), token_after_tensor(hidden[:, 0].long())] = 1.0
        return logits


def token_after_tensor(positions: torch.Tensor) -> torch.Tensor:
    return (positions * 7 + 3) % VOCAB


def make_runner() -> tuple[ModelRunner, RecorderModel]:
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, hidden_size=1,
                         vocab_size=VOCAB)
    config = EngineConfig(
        model_config=ModelConfig("none", torch.float32, MAX_LEN, hf_config=hf),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS))
    model = RecorderModel()
    return ModelRunner(config, model, [], torch.device("cpu")), model


class Reference:
    """What the runner should see, from Python lists only."""

    def __init__(self) -> None:
        self.prompt: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}  # prefill tokens + sampled tokens
        self.prefill_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.running: list[str] = []
        self.next_block = 1

    def take_blocks(self, req_id: str, num_tokens: int) -> list[int]:
        need = -(-num_tokens // BLOCK) - len(self.blocks[req_id])
        new = list(range(self.next_block, self.next_block + need))
        self.next_block += need
        self.blocks[req_id] += new
        return new


@st.composite
def actions(draw):
    """A list of steps; each step is a list of (op, arg) applied before scheduling."""
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        ops = draw(st.lists(st.tuples(st.sampled_from(["add", "finish", "preempt", "resume"]),
                                      st.integers(0, 10**6)), max_size=3))
        chunk_seed = draw(st.integers(0, 10**6))
        steps.append((ops, chunk_seed))
    return steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions())
def test_prepared_inputs_match_list_reference(steps):
    runner, model = make_runner()
    ref = Reference()
    preempted: list[str] = []
    counter = 0
    for ops, chunk_seed in steps:
        new_reqs, finished, preempted_now = [], [], []
        for op, arg in ops:
            if op == "add" and len(ref.running) < MAX_SEQS:
                req_id = f"r{counter}"
                counter += 1
                prompt = [(arg + 5 * i) % VOCAB for i in range(1 + arg % 20)]
                ref.prompt[req_id] = prompt
                ref.tokens[req_id] = list(prompt)
                ref.prefill_len[req_id], ref.computed[req_id] = len(prompt), 0
                ref.blocks[req_id] = []
                ref.running.append(req_id)
                new_reqs.append(req_id)
            elif op in ("finish", "preempt") and ref.running:
                req_id = ref.running[arg % len(ref.running)]
                if req_id in new_reqs:
                    continue
                ref.running.remove(req_id)
                (finished if op == "finish" else preempted_now).append(req_id)
            elif op == "resume" and preempted and len(ref.running) < MAX_SEQS:
                req_id = preempted.pop(arg % len(preempted))
                # Recompute: prefill = prompt + outputs so far, fresh blocks.
                ref.prefill_len[req_id], ref.computed[req_id] = len(ref.tokens[req_id]), 0
                ref.blocks[req_id] = []
                ref.running.append(req_id)
                new_reqs.append(req_id)
        preempted += preempted_now

        # Schedule: every running request gets a chunk within the token budget; a request
        # that cannot fit its whole sequence in MAX_LEN stops growing.
        budget, scheduled = MAX_TOKENS, {}
        for i, req_id in enumerate(ref.running):
            remaining = len(ref.tokens[req_id]) - ref.computed[req_id]
            if remaining <= 0 or budget == 0 or len(ref.tokens[req_id]) >= MAX_LEN - 1:
                continue
            n = min(remaining, budget, 1 + (chunk_seed >> i) % 9)
            scheduled[req_id] = n
            budget -= n
        cached_ids = [r for r in scheduled if r not in new_reqs]
        new_data = []
        for req_id in new_reqs:
            n = scheduled.get(req_id, 0)
            blocks = ref.take_blocks(req_id, ref.computed[req_id] + n)
            prefill = ref.tokens[req_id][:ref.prefill_len[req_id]]
            new_data.append(NewRequestData(req_id, ref.prompt[req_id], prefill, GREEDY,
                                           [blocks], ref.computed[req_id]))
        cached = CachedRequestData.build(
            cached_ids, [[ref.take_blocks(r, ref.computed[r] + scheduled[r])] for r in cached_ids],
            [ref.computed[r] for r in cached_ids])
        # Batch order as the scheduler sends it: running (cached) first, then new.
        order = cached_ids + [r for r in new_reqs if r in scheduled]
        out = SchedulerOutput.build(new_data, cached, {r: scheduled[r] for r in order},
                              sum(scheduled.values()), finished, preempted_now)
        model.calls.clear()
        runner.execute_model(out)
        result = runner.sample_tokens(None)
        if not scheduled:
            assert model.calls == [] and result.req_ids == []
            continue

        # Reference inputs in decode-first (stable) order.
        batch = sorted(order, key=lambda r: scheduled[r] > 1)
        exp = {"input_ids": [], "positions": [], "slot_mapping": [], "query_start_loc": [0],
               "seq_lens": [], "block_tables": []}
        for req_id in batch:
            start, n = ref.computed[req_id], scheduled[req_id]
            for pos in range(start, start + n):
                exp["input_ids"].append(ref.tokens[req_id][pos])
                exp["positions"].append(pos)
                blocks = ref.blocks[req_id]
                exp["slot_mapping"].append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
            exp["query_start_loc"].append(exp["query_start_loc"][-1] + n)
            exp["seq_lens"].append(start + n)
        (got,) = model.calls
        for key in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
            assert got[key] == exp[key], key
        assert got["seq_lens_np"] == exp["seq_lens"]
        assert got["num_decodes"] == sum(scheduled[r] == 1 for r in batch)
        for row, req_id in zip(got["block_tables"], batch):
            blocks = ref.blocks[req_id]
            assert row[:len(blocks)] == blocks

        # Advance the reference: rows that completed their prefill sampled a token.
        sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        assert set(sampled) == set(batch)
        for req_id in batch:
            ref.computed[req_id] += scheduled[req_id]
            if ref.computed[req_id] >= ref.prefill_len[req_id]:
                want = token_after(ref.computed[req_id] - 1)
                assert sampled[req_id] == [want]
                ref.tokens[req_id].append(want)
            else:
                assert sampled[req_id] == []
