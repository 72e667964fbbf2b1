"""Tensor parallelism end to end: `LLM(..., tensor_parallel_size=2)` on CPU (gloo) gives the
greedy tokens of tensor_parallel_size=1 and of transformers, on several architectures; head
counts the ranks cannot split are refused before any worker starts."""

from __future__ import annotations

import operator
import os
import random
import signal
import threading
import time

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError
from mrv2.errors import EngineDeadError
from mrv2.testing.leftovers import wait_for_no_leftovers

import executor_helpers

MAX_TOKENS = 16
# Lengths around the block size (16) and a multi-block prompt.
PROMPT_LENS = [1, 4, 15, 17, 40]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Every rank samples from the same all-gathered logits with the same seeded noise; a rank that
# drew other tokens would feed its model other inputs and the outputs would drift from tp=1.
SEEDED = SamplingParams(temperature=0.7, top_k=50, seed=7, max_tokens=MAX_TOKENS,
                        ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(99)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in PROMPT_LENS]


def _hf_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(
                1, len(ids), dtype=torch.long), max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def _assert_sharded(executor, model_dir, tp: int) -> None:
    """Each rank holds its 1/tp of the heads and of the vocabulary (equal outputs alone would
    not show that the ranks split the work)."""
    from safetensors import safe_open

    heads = executor.collective_rpc(operator.attrgetter("model.model.layers.0.self_attn"
                                                        ".num_heads"))
    assert heads == [4 // tp] * tp
    shards = executor.collective_rpc(operator.attrgetter("model.model.embed_tokens.weight"))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    assert all(s.shape[0] < table.shape[0] for s in shards)
    assert torch.equal(torch.cat(shards)[:table.shape[0]], table)


def _assert_experts_split(executor, experts: list[int]) -> None:
    """Under expert parallelism rank r holds experts[r] experts of layer 0, whole (2I rows of
    gate/up: the intermediate is not split)."""
    layer = "model.model.layers.0.mlp.experts"
    counts = executor.collective_rpc(operator.attrgetter(f"{layer}.num_local_experts"))
    shapes = executor.collective_rpc(operator.attrgetter(f"{layer}.gate_up_proj.shape"))
    inter = executor.collective_rpc(operator.attrgetter(f"{layer}.intermediate_size"))
    assert counts == experts
    assert [list(s[:2]) for s in shapes] == [[n, 2 * inter[0]] for n in experts]


def _run(model_dir, tp: int, prompts, params_list,
         expert_split: list[int] | None = None) -> list[list[list[int]]]:
    """One LLM, one generate per SamplingParams; the token ids of each. `expert_split`: with
    enable_expert_parallel, rank r holding expert_split[r] experts."""
    llm = LLM(str(model_dir), tensor_parallel_size=tp, max_model_len=128,
              enable_expert_parallel=expert_split is not None)
    try:
        if tp > 1:
            executor = llm.llm_engine.engine_core.executor
            assert len(executor_helpers.worker_pids(executor)) == tp
            _assert_sharded(executor, model_dir, tp)
            if expert_split is not None:
                _assert_experts_split(executor, expert_split)
        results = []
        for params in params_list:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
            results.append([list(o.outputs[0].token_ids) for o in outputs])
        return results
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch, extra, seeded", [
    ("llama", {}, True),
    ("qwen2", {}, False),  # q/k/v bias: column-parallel bias shards
    # q/k norm; the LM head is the tied, vocab-parallel embedding
    ("qwen3", {"tie_word_embeddings": True}, False),
    # fused qkv / gate_up checkpoint tensors split per rank; partial rotary
    ("phi3", {"config": {"partial_rotary_factor": 0.5}}, False),
    # q/k norms over the whole projection (all-gathered); norms after the sublayers
    ("olmo2", {}, False),
    # sandwich norms of 1 + w, scaled embeddings, GeLU, windows, soft caps, local rope
    ("gemma3", {"config": {"sliding_window": 5, "attn_logit_softcapping": 1.5,
                           "final_logit_softcapping": 8.0}}, False),
    # Gemma 4: wider global heads (values = keys), per-layer inputs (replicated), KV-shared
    # layers reading their sources' per-rank caches
    ("gemma4", {"num_layers": 4, "config": {
        "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "global_head_dim": 32, "num_global_key_value_heads": 2, "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 2048,
        "num_kv_shared_layers": 2}}, False),
    # Experts: every rank holds each expert's half of the intermediate (all-reduced once), and
    # the shared expert and its gate; a dense mlp-only layer between.
    ("qwen2_moe", {"num_layers": 3, "config": {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "mlp_only_layers": [1]}}, False),
])
def test_tp2_matches_tp1_and_transformers(tiny_model_factory, arch, extra, seeded):
    model_dir = tiny_model_factory(arch, num_heads=4, num_kv_heads=2, **extra)
    prompts = _prompts()
    params = [GREEDY, SEEDED] if seeded else [GREEDY]
    tp1 = _run(model_dir, 1, prompts, params)
    tp2 = _run(model_dir, 2, prompts, params)
    assert tp1[0] == _hf_greedy(model_dir, prompts)
    assert tp2[0] == tp1[0]
    if seeded:
        assert tp2[1] == tp1[1]
        assert tp2[1] != tp2[0]  # the sampled run really sampled


def test_tp2_expert_parallel_matches_tp1(tiny_model_factory):
    """enable_expert_parallel: each rank holds whole experts (5 over 2 ranks: 3 and 2) and
    computes only their pairs, the block all-reduced; attention stays head-sharded."""
    model_dir = tiny_model_factory("qwen3_moe", num_heads=4, num_kv_heads=2, num_layers=2,
                                   config={"num_experts": 5, "num_experts_per_tok": 2,
                                           "moe_intermediate_size": 24, "norm_topk_prob": True})
    prompts = _prompts()
    tp1 = _run(model_dir, 1, prompts, [GREEDY])
    assert _run(model_dir, 2, prompts, [GREEDY], expert_split=[3, 2]) == tp1  # vLLM's split


def test_tp2_expert_parallel_keeps_each_ranks_experts_on_the_gguf_blocks(tiny_gguf_factory,
                                                                          monkeypatch):
    """quantization="gguf" under expert parallelism: each rank packs its own experts whole
    from the file's blocks (no float parameters left) and gives the dequantized model's tokens
    (float32 x on the blocks: MRV2_GGUF_ACTIVATIONS, read by the spawned workers)."""
    monkeypatch.setenv("MRV2_GGUF_ACTIVATIONS", "float32")
    path = tiny_gguf_factory("qwen3_moe", "Q8_0", num_heads=4, num_kv_heads=2, num_layers=2,
                             config={"num_experts": 5, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True})
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    llm = LLM(str(path), max_model_len=128)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.shutdown()
    llm = LLM(str(path), max_model_len=128, tensor_parallel_size=2, quantization="gguf",
              enable_expert_parallel=True)
    try:
        executor = llm.llm_engine.engine_core.executor
        layer = "model.model.layers.0.mlp.experts"
        assert executor.collective_rpc(operator.attrgetter(f"{layer}.num_local_experts")) == [3, 2]
        shapes = executor.collective_rpc(operator.attrgetter(f"{layer}.gate_up_proj.shape"))
        assert [list(s) for s in shapes] == [[0], [0]]  # released: the packed blocks compute
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want


def test_tp2_logprobs_and_prompt_logprobs_match_tp1(tiny_model_factory):
    """Every rank computes the prompt rows' logits too (the LM head all-gathers): a rank that
    skipped them would hang the others."""
    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    results = []
    for tp in (1, 2):
        llm = LLM(str(model_dir), tensor_parallel_size=tp, max_model_len=128,
                  max_num_batched_tokens=32)
        try:
            results.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.shutdown()
    for one, two in zip(*results):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs + one.prompt_logprobs[1:],
                        two.outputs[0].logprobs + two.prompt_logprobs[1:]):
            assert list(a) == list(b)
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("tp, what", [(3, "num_attention_heads=4"),
                                      (4, "num_key_value_heads=2")])
def test_tp_not_dividing_heads_refused(tiny_model_factory, tp, what):
    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    with pytest.raises(ConfigError, match=f"tensor_parallel_size={tp}.*{what}"):
        LLM(str(model_dir), tensor_parallel_size=tp, max_model_len=128)


def test_tp_with_in_process_backend_refused(tiny_model_factory):
    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    with pytest.raises(ConfigError, match="distributed_executor_backend='mp'"):
        LLM(str(model_dir), tensor_parallel_size=2, max_model_len=128,
            distributed_executor_backend="uni")


def test_tp2_rank_killed_raises_engine_dead(tiny_model_factory):
    # The surviving rank blocks in a collective; the executor must still fail fast and stop it.
    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    llm = LLM(str(model_dir), tensor_parallel_size=2, max_model_len=2048)
    pids = executor_helpers.worker_pids(llm.llm_engine.engine_core.executor)
    shm_names = executor_helpers.shm_names(llm.llm_engine.engine_core.executor)
    assert len(shm_names) == 3  # the broadcast queue and one reply queue per rank
    try:
        killer = threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL))
        long = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        killer.start()
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, long, use_tqdm=False)
        assert time.monotonic() - start < 0.5 + 5.0
    finally:
        llm.shutdown()
    wait_for_no_leftovers(pids, shm_names)


def test_a_peers_error_before_a_rank_death_shows_reports_the_death(tiny_model_factory):
    # A step's call waits for rank 0's reply alone. Rank 0's error arrives first; rank 1 dies
    # 0.2 s later, within the grace an error reply waits for a death to show: the death is the
    # cause, and it is what is raised.
    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    llm = LLM(str(model_dir), tensor_parallel_size=2, max_model_len=128)
    executor = llm.llm_engine.engine_core.executor
    pids, shm_names = executor_helpers.worker_pids(executor), executor_helpers.shm_names(executor)
    try:
        with pytest.raises(EngineDeadError, match="rank 1"):
            executor_helpers.output_rank_rpc(
                executor, executor_helpers.fail_on_rank_0_then_die_on_rank_1, (0.2,))
    finally:
        llm.shutdown()
    wait_for_no_leftovers(pids, shm_names)


def test_tp2_gguf_matches_tp1(tiny_gguf_factory):
    """GGUF weights shard like safetensors ones: llama's permuted q/k rows are un-permuted
    before a rank takes its heads, quantized rows are dequantized per rank."""
    path = tiny_gguf_factory("llama", "Q8_0", num_heads=4, num_kv_heads=2)
    prompts = _prompts()
    llm = LLM(str(path), tensor_parallel_size=2, max_model_len=128)
    try:
        executor = llm.llm_engine.engine_core.executor
        heads = executor.collective_rpc(operator.attrgetter("model.model.layers.0.self_attn"
                                                            ".num_heads"))
        assert heads == [2, 2]
        tp2 = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert tp2 == _run(path, 1, prompts, [GREEDY])[0]
