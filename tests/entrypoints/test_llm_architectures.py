"""End to end on each architecture of issue 49 that the Llama-family layers compute
(Phi-3 with LongRoPE, partial rotary and a sliding window, SmolLM3 with NoPE layers, OLMo 2,
Gemma 2 with soft caps, Gemma 3 with its local rope, Gemma 4 with wide global heads, per-layer
inputs and KV-shared layers,
Mistral and Qwen2 with sliding windows shorter than the prompts, Ministral 3 (Mistral 3's text
model), Llama with YaRN and dynamic NTK, the MoE models: Qwen3-MoE, Qwen2-MoE, Mixtral,
OLMoE): greedy tokens equal transformers' on the same random
weights through chunked prefill (a budget smaller than the prompts), a prefix-cache hit and
preemption."""

from __future__ import annotations

import random

import pytest

from transformers import AutoConfig

from mrv2 import LLM, SamplingParams
from mrv2.core.kv_cache_layout import KVCacheLayout, layer_kv_shape
from tests.entrypoints.test_llm import hf_greedy

MAX_TOKENS = 12
_GEMMA4_LAYERS = (["sliding_attention"] * 2 + ["full_attention"]
                  + ["sliding_attention", "full_attention"] * 2)
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1e6}}
CASES = {
    "phi3-longrope": ("phi3", {"rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0],
        "long_factor": [3.0, 3.0, 5.0, 9.0]},
        "config": {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 256,
                   "sliding_window": 24}}),
    "mistral-window": ("mistral", {"config": {"sliding_window": 10}}),
    "qwen2-window": ("qwen2", {"num_layers": 3, "config": {
        "use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1}}),
    "smollm3": ("smollm3", {"num_layers": 4, "config": {"no_rope_layers": [1, 1, 0, 1]}}),
    "olmo2": ("olmo2", {}),
    "gemma2": ("gemma2", {"config": {
        "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 8.0}}),  # not saturated: no exact ties
    "gemma3": ("gemma3", {"num_layers": 3, "config": {
        "sliding_window": 9, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}}),
    # Gemma 4: wider global heads with one kv head (values = keys), proportional rope, per-layer
    # inputs, the last two layers reusing earlier layers' caches with double-wide MLPs.
    "gemma4": ("gemma4", {"num_layers": 7, "tie_word_embeddings": True, "config": {
        "sliding_window": 9, "layer_types": _GEMMA4_LAYERS, "global_head_dim": 32,
        "num_global_key_value_heads": 2, "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 2048,
        "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
        "final_logit_softcapping": 20.0, "rope_parameters": _GEMMA4_ROPE}}),
    # Gemma 4 without per-layer inputs or KV sharing, separate values, one head width.
    "gemma4-plain": ("gemma4", {"num_layers": 3, "config": {
        "sliding_window": 9, "layer_types": _GEMMA4_LAYERS[:3], "global_head_dim": 16,
        "hidden_size_per_layer_input": 0, "rope_parameters": _GEMMA4_ROPE}}),
    # Mistral 3's text model: YaRN, and queries scaled by position past the original context.
    "ministral3": ("ministral3", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.4}}),
    # Mixture of experts (layers/moe.py): Qwen3-MoE with renormalised top-2 of 8, a dense
    # mlp-only layer; Qwen2-MoE with top-3 of 16 not renormalised, routed every 2nd layer, a
    # shared expert; Mixtral top-1 of 4 (its checkpoint names); OLMoE top-4 of 8, q/k norms
    # over the projections.
    "qwen3-moe": ("qwen3_moe", {"num_layers": 3, "config": {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "norm_topk_prob": True, "mlp_only_layers": [1]}}),
    "qwen2-moe": ("qwen2_moe", {"num_layers": 3, "config": {
        "num_experts": 16, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96, "decoder_sparse_step": 2}}),
    "mixtral": ("mixtral", {"config": {"num_local_experts": 4, "num_experts_per_tok": 1}}),
    "olmoe": ("olmoe", {"config": {"num_experts": 8, "num_experts_per_tok": 4}}),
    "llama-yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32}}),
    "llama-dynamic": ("llama", {"max_position_embeddings": 256,
                                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_transformers(tiny_model_factory, name):
    arch, kwargs = CASES[name]
    model_dir = tiny_model_factory(arch, **kwargs)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (3, 19, 45, 70)]
    prompts.append(prompts[3][:64] + [11, 12])  # a prefix-cache hit on the last prompt's
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    # Room for one request of max_model_len and the null block, for ~270 tokens of prompts
    # and outputs: requests are preempted. A windowed layer's blocks behind its window are
    # given back (core/kv_cache_layout.py): its requests need fewer.
    hf = AutoConfig.from_pretrained(model_dir)
    layout = KVCacheLayout.for_model(hf)
    num_blocks = layout.max_blocks_per_request(96, 8, 32) + 1
    width = max(heads * dim for heads, dim in (layer_kv_shape(hf, layer)
                                               for layer in range(hf.num_hidden_layers)))
    block_bytes = 2 * 8 * width * 4 * layout.num_tensors
    llm = LLM(str(model_dir), max_model_len=96, block_size=8, max_num_batched_tokens=32,
              enable_prefix_caching=True,
              kv_cache_memory_gb=num_blocks * block_bytes / (1 << 30))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        again = llm.generate([{"prompt_token_ids": prompts[3]}], params, use_tqdm=False)
        assert again[0].outputs[0].token_ids == expected[3]
        scheduler = llm.llm_engine.engine_core.scheduler
        assert scheduler.num_preemptions > 0
        assert scheduler.kv_cache_manager.prefix_cache_stats.hits >= 64
    finally:
        llm.shutdown()


def _kv_blocks_in_use(llm: LLM) -> float:
    usage = next(m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc")
    return usage * (llm.llm_engine.get_stats().num_kv_blocks - 1)


@pytest.mark.parametrize("windows", ["all", "alternate"])
def test_prompts_8x_the_window_hold_blocks_bounded_by_it(tiny_model_factory, windows):
    """Three prompts of 8 windows each, prefilled in chunks: the windowed layers give their
    blocks behind the window back, so the KV blocks in use (vLLM's kv_cache_usage_perc) stay
    bounded by the window; the full-attention layers of a hybrid model keep theirs. The tokens
    stay transformers'."""
    window, block, chunk, prompt_len = 16, 4, 16, 128
    layer_types = {"all": None, "alternate": ["sliding_attention", "full_attention"] * 2}
    config = {"sliding_window": window, "layer_types": layer_types[windows]}
    model_dir = tiny_model_factory("qwen2", num_layers=4, config={
        **config, "use_sliding_window": True, "max_window_layers": 0})
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 2000) for _ in range(prompt_len)] for _ in range(3)]
    expected = hf_greedy(model_dir, prompts, 4)
    llm = LLM(str(model_dir), max_model_len=160, block_size=block, dtype="float32",
              max_num_batched_tokens=chunk, enable_prefix_caching=False)
    try:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        peak, outputs = 0.0, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
            peak = max(peak, _kv_blocks_in_use(llm))
        assert [outputs[str(i)] for i in range(3)] == expected
        layout = engine.engine_core.scheduler.kv_cache_manager.layout
        per_request = layout.max_blocks_per_request(prompt_len + 4, block, chunk)
        whole = -(-(prompt_len + 4) // block)
        assert 0 < peak <= 3 * per_request
        if windows == "all":  # a window and a chunk's worth, not the prompt's
            assert per_request < whole // 3
        else:  # the full group's blocks and a window and a chunk's worth of the other's
            assert per_request < whole + whole // 3
    finally:
        llm.shutdown()
