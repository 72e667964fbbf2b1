"""Qwen3-Next and Qwen3.5, dense and MoE (models/qwen3_next.py): greedy tokens and prompt
logprobs of random-weight checkpoints equal transformers' through chunked prefill (a budget
smaller than the prompts), slot reuse (more requests than slots), async scheduling (the
default) and preemption (a KV pool smaller than the batch), and under tensor parallelism 2;
what the model declares and what hybrid models refuse."""

from __future__ import annotations

import random

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError
from mrv2.core.kv_cache_layout import KVCacheLayout, recurrent_state_shapes
from mrv2.engine.arg_utils import EngineArgs
from mrv2.models.cpu import decode
from tests.entrypoints.test_llm import hf_greedy

ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
MAX_TOKENS = 12
MAX_NUM_SEQS = 3
BLOCK = 8


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in (3, 19, 45, 70, 9)]


def _hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """transformers' logprob of each prompt token after the first [len - 1], float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def _budget_gb(model_dir, num_blocks: int) -> float:
    """KV memory for `num_blocks` blocks of the full-attention layers, plus every slot's state
    in the recurrent layers (the worker takes those first)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    layout = KVCacheLayout.for_model(hf)
    block_bytes = 2 * BLOCK * hf.num_key_value_heads * hf.head_dim * 4 * layout.num_tensors
    (channels, width), memory = recurrent_state_shapes(hf)
    state = 4 * len(layout.recurrent) * MAX_NUM_SEQS * (channels * width + memory[0]
                                                        * memory[1] * memory[2])
    return (num_blocks * block_bytes + state) / (1 << 30)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_prompt_logprobs_match_transformers(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch, num_layers=4)
    prompts = _prompts()
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    want_logprobs = _hf_prompt_logprobs(model_dir, prompts[3])
    # Room for one request of max_model_len and the null block: five requests of 3-70 prompt
    # tokens preempt each other; three slots for five requests: slots are reused. Async
    # scheduling (off by default in one CPU process): placeholders over recurrent state too.
    llm = LLM(str(model_dir), max_model_len=96, block_size=BLOCK, max_num_batched_tokens=16,
              max_num_seqs=MAX_NUM_SEQS, kv_cache_memory_gb=_budget_gb(model_dir, 13),
              async_scheduling=True)
    try:
        config = llm.llm_engine.config
        assert not config.cache_config.enable_prefix_caching  # off by default for hybrids
        assert config.scheduler_config.async_scheduling
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        [scored] = llm.generate([{"prompt_token_ids": prompts[3]}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        got = torch.tensor([next(iter(p.values())).logprob
                            for p, token in zip(scored.prompt_logprobs[1:], prompts[3][1:])])
        # 1e-4, plus float32's relative rounding for the unlikely tokens: these random models'
        # logprobs reach -30, where the two summation orders (the chunked delta rule in
        # transformers, the recurrent one here) differ by ~1e-4 alone.
        assert torch.allclose(got, want_logprobs, atol=1e-4, rtol=1e-5), \
            (got - want_logprobs).abs().max()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_two_tensor_parallel_ranks_give_the_same_tokens(tiny_model_factory, arch):
    """Each rank holds one of the two key heads and its two value heads (Qwen3-Next's grouped
    projections split whole groups; Qwen3.5's q/k/v and the convolution per segment)."""
    model_dir = tiny_model_factory(arch, num_layers=4)
    prompts = _prompts()[:4]
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(str(model_dir), max_model_len=96, max_num_batched_tokens=16,
              tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.shutdown()


def test_declares_its_layers_and_keeps_no_kv_blocks_for_the_recurrent_ones(tiny_model_factory):
    from transformers import AutoConfig

    from mrv2.config import ModelConfig
    from mrv2.models import load_hf_config, load_model

    model_dir = tiny_model_factory("qwen3_next", num_layers=4)
    hf = load_hf_config(str(model_dir))
    model = load_model(ModelConfig(model=str(model_dir), dtype=torch.float32, max_model_len=64,
                                   hf_config=hf), torch.device("cpu"))
    spec = model.decoder_spec
    assert spec.linear_attention == (True, True, True, False) and spec.attention_output_gate
    assert spec.norm_unit_offset and spec.moe is not None and spec.moe.shared_intermediate_size
    assert decode.fused_decode(model) is not None  # its decode steps on the fused stack
    layout = KVCacheLayout.for_model(AutoConfig.from_pretrained(model_dir))
    assert layout.recurrent == (0, 1, 2) and layout.groups[0].layers == (3,)
    assert layout.layer_group[:3] == (-1, -1, -1) and layout.num_tensors == 1


@pytest.mark.parametrize("setting, message", [
    (dict(enable_prefix_caching=True), "enable_prefix_caching=True"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative decoding"),
    (dict(batch_invariant=True), "batch_invariant=True"),
    (dict(pipeline_parallel_size=2), "pipeline"),
])
def test_what_hybrid_models_do_not_run_is_refused_by_name(tiny_model_factory, setting, message):
    model_dir = tiny_model_factory("qwen3_5", num_layers=4)
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=str(model_dir), max_model_len=64, **setting).create_engine_config()


def test_a_hybrid_draft_model_is_refused(tiny_model_factory, tiny_llama):
    draft = tiny_model_factory("qwen3_5", num_layers=4)
    with pytest.raises(ConfigError, match="hybrid"):
        EngineArgs(model=str(tiny_llama), max_model_len=64, speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 2},
        ).create_engine_config()
