"""End to end on each architecture of issue 49 that the Llama-family layers compute
(Phi-3 with LongRoPE, partial rotary and a sliding window, SmolLM3 with NoPE layers, OLMo 2,
Gemma 2 with soft caps, Gemma 3 with its local rope,
Mistral and Qwen2 with sliding windows shorter than the prompts, Llama with YaRN and dynamic
NTK): greedy tokens equal transformers' on the same random weights through chunked
prefill (a budget smaller than the prompts), a prefix-cache hit and preemption."""

from __future__ import annotations

import random

import pytest

from mrv2 import LLM, SamplingParams
from tests.entrypoints.test_llm import hf_greedy

MAX_TOKENS = 12
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
    # 14 blocks of 8 tokens for ~270 tokens of prompts and outputs: requests are preempted.
    block_bytes = 2 * 2 * 8 * 2 * 16 * 4 * {"smollm3": 4, "qwen2": 3, "gemma3": 3}.get(arch, 2) // 2
    llm = LLM(str(model_dir), max_model_len=96, block_size=8, max_num_batched_tokens=32,
              enable_prefix_caching=True, kv_cache_memory_gb=14 * block_bytes / (1 << 30))
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
