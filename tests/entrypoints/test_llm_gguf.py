"""The built-in SmolLM2-135M-Instruct Q4_1 GGUF end to end: greedy tokens equal transformers'
on the same file (its own GGUF loader, float32), through chunked prefill, prefix-cache hits and
the OpenAI server."""

from __future__ import annotations

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.builtin import builtin_model_path
from mrv2.testing.tokenizer import DEFAULT_VOCAB_SIZE

QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me one tip for sleeping better.",
    "What is the boiling point of water in Celsius?",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    # A 64-token budget splits every chat prompt (~35-45 tokens) of a batch of 8 over several
    # steps: the prefills are chunked.
    llm = LLM(str(builtin_model_path()), max_model_len=512, max_num_batched_tokens=64,
              kv_cache_memory_gb=0.1)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def chat_prompts(smollm2: LLM) -> list[list[int]]:
    tokenizer = smollm2.get_tokenizer()
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(chat_prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, EOS included, as mrv2 reports them."""
    from transformers import AutoModelForCausalLM

    from mrv2.testing.gguf_twin import safetensors_twin

    # transformers' own load of the file, kept on disk after the first run (its GGUF path
    # takes tens of seconds; the twin reloads bit for bit in a fraction of one).
    model = AutoModelForCausalLM.from_pretrained(safetensors_twin(builtin_model_path()),
                                                 dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    out = []
    with torch.no_grad():
        for prompt in chat_prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                 do_sample=False)[0, len(prompt):].tolist()
            out.append(ids[:ids.index(eos) + 1] if eos in ids else ids)
    return out


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_tokens_equal_transformers_with_chunked_prefill(smollm2, chat_prompts, reference):
    assert _greedy(smollm2, chat_prompts) == reference


def test_prefix_hits_give_the_same_tokens(smollm2, chat_prompts, reference):
    stats = smollm2.llm_engine.engine_core.scheduler.prefix_cache_stats
    hits_before = stats.hits
    # Same prompts again (cached), and in reverse order next to each other.
    assert _greedy(smollm2, chat_prompts) == reference
    assert stats.hits - hits_before >= 16 * len(chat_prompts)  # the shared system prompt at least
    assert _greedy(smollm2, chat_prompts[::-1]) == reference[::-1]


def test_blocks_as_stored_give_the_float32_tokens(chat_prompts, reference):
    """quantization="gguf": the linears on the Q4_1 blocks (float32 x, the default) give
    transformers' greedy tokens on every prompt (int8 x does not: bench/README.md)."""
    llm = LLM(str(builtin_model_path()), max_model_len=512, kv_cache_memory_gb=0.1,
              quantization="gguf")
    assert llm.llm_engine.engine_core.executor.worker.runner.model.model.layers[
        0].mlp.down_proj.weight.numel() == 0  # the blocks, not a dequantized copy
    got = _greedy(llm, chat_prompts)
    llm.shutdown()
    assert got == reference


def test_chat_answers_paris(smollm2):
    output = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"


def test_bfloat16_chat_answers_paris_alone_and_in_the_demos_batch():
    """Issue 47: in bfloat16 (the default dtype on a CPU with bf16 matrix units) the demo's
    batch of four chats answered "L'Étoile, ..." while the chat alone said Paris: from 2 rows
    the LM head rounded its logits to bfloat16, tying "The" and "L" (25.125 = 25.125)."""
    from mrv2.entrypoints.cli import DEFAULT_QUESTIONS

    llm = LLM(str(builtin_model_path()), dtype="bfloat16", max_model_len=256,
              kv_cache_memory_gb=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    try:
        alone = llm.chat([{"role": "user", "content": DEFAULT_QUESTIONS[0]}], params,
                         use_tqdm=False)[0].outputs[0].text
        batch = llm.chat([[{"role": "user", "content": q}] for q in DEFAULT_QUESTIONS], params,
                         use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    assert "Paris" in alone and "Paris" in batch, (alone, batch)


def test_server_answers_as_transformers(smollm2, reference):
    import httpx

    from mrv2.testing import ServerProcess

    tokenizer = smollm2.get_tokenizer()
    with ServerProcess(builtin_model_path(), ["--max-model-len", "512",
                                              "--kv-cache-memory-gb", "0.1"]) as server:
        for question, expected in zip(QUESTIONS[:2], reference[:2]):
            body = {"model": str(builtin_model_path()), "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "messages": [{"role": "user", "content": question}]}
            reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert choice["message"]["content"] == tokenizer.decode(expected,
                                                                    skip_special_tokens=True)
            assert choice["finish_reason"] == ("stop" if len(expected) < MAX_TOKENS
                                               else "length")


# -- the random-weight test models written as GGUF by llama.cpp's converter's rules ---------------

PROMPTS = [[5, 17, 300, 42, 9], [1000, 3, 3, 3, 77, 12, 400, 8, 1500], [250]]
TINY_TOKENS = 12
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def _mrv2_tokens(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, max_model_len=256, kv_cache_memory_gb=0.02, **kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=TINY_TOKENS,
                                              ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def _hf_tokens(model) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=TINY_TOKENS,
                                 min_new_tokens=TINY_TOKENS, do_sample=False)
            out.append(ids[0, len(prompt):].tolist())
    return out


def _hf_from_gguf(path, config_dir=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers reads no key_length for qwen3 (it would assume head_dim 128): give it the
    # source config; the weights still come from the GGUF file alone.
    config = AutoConfig.from_pretrained(config_dir) if config_dir is not None else None
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_gguf_greedy_equals_transformers_on_the_same_file(
        tiny_model_factory, tiny_gguf_factory, arch, tensor_type):
    path = tiny_gguf_factory(arch, tensor_type)
    config_dir = tiny_model_factory(arch) if arch == "qwen3" else None
    assert _mrv2_tokens(str(path)) == _hf_tokens(_hf_from_gguf(path, config_dir))


def test_split_gguf_gives_the_tokens_of_the_single_file(tiny_gguf_factory):
    assert (_mrv2_tokens(str(tiny_gguf_factory("qwen2", "Q8_0", num_splits=3)))
            == _mrv2_tokens(str(tiny_gguf_factory("qwen2", "Q8_0"))))


def test_llama3_rope_gguf_equals_the_safetensors_model(tiny_model_factory, tiny_gguf_factory):
    """transformers ignores the rope_freqs tensor of a GGUF; mrv2 applies it, so an F32 file
    gives the tokens of the original (safetensors) model, which transformers runs."""
    from transformers import AutoModelForCausalLM

    source = tiny_model_factory("llama", rope_scaling=LLAMA3_ROPE, max_position_embeddings=4096)
    path = tiny_gguf_factory("llama", "F32", rope_scaling=LLAMA3_ROPE,
                             max_position_embeddings=4096)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert _mrv2_tokens(str(path)) == _hf_tokens(hf)


def test_gguf_with_tokenizer_and_config_overrides(tiny_model_factory, tiny_gguf_factory):
    source = tiny_model_factory("qwen3")
    path = tiny_gguf_factory("qwen3", "F16")
    llm = LLM(str(path), tokenizer=str(source), hf_config_path=str(source), max_model_len=128,
              kv_cache_memory_gb=0.02)
    try:
        config = llm.llm_engine.config.model_config
        assert config.tokenizer_path == str(source)
        assert config.hf_config.name_or_path == str(source)
        assert llm.generate("hello world", SamplingParams(max_tokens=3, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


# Gemma as llama.cpp reads a Gemma GGUF: the converter writes neither the layer pattern nor the
# attention scale, so the source checkpoints follow llama.cpp's conventions (every 2nd / 6th
# layer global, query_pre_attn_scalar = head_dim), tie their embeddings (the converter drops
# lm_head) and keep only the tokenizer's rows (it drops the rest). Gemma 3's windowed layers'
# rope base travels as rope.freq_base_swa (20000 here, not llama.cpp's default).
GEMMA_GGUF = {
    "gemma2": {"config": {"sliding_window": 4, "query_pre_attn_scalar": 16,
                          "layer_types": ["sliding_attention", "full_attention"],
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 9.0}},
    "gemma3": {"num_layers": 6, "config": {
        "sliding_window": 5, "query_pre_attn_scalar": 16, "final_logit_softcapping": 9.0,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}},
    # Gemma 4: per-layer kv heads and MLP widths as arrays, wider global heads with k = v and
    # proportional rope (the rope_freqs tensor), KV-shared layers, per-layer inputs.
    "gemma4": {"num_layers": 5, "config": {
        "sliding_window": 5, "final_logit_softcapping": 10.0,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention", "full_attention"],
        "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": DEFAULT_VOCAB_SIZE,
        "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6}}}},
}


@pytest.mark.usefixtures("float_activations")
@pytest.mark.parametrize("arch", list(GEMMA_GGUF))
def test_gemma_gguf_equals_the_safetensors_model(tiny_model_factory, tiny_gguf_factory, arch):
    """Norms stored as 1 + w, windows, soft caps, the local rope: an F32 file gives the tokens
    transformers gives on the source checkpoint; a Q8_0 file computed on as stored (float32
    activations) the tokens of its dequantized weights."""
    kwargs = {**GEMMA_GGUF[arch], "vocab_size": DEFAULT_VOCAB_SIZE, "tie_word_embeddings": True}
    _check_gguf_against_source(tiny_model_factory, tiny_gguf_factory, arch, kwargs)


def _check_gguf_against_source(tiny_model_factory, tiny_gguf_factory, arch: str,
                               kwargs: dict) -> None:
    """The F32 file's tokens are transformers' on the source checkpoint; the Q8_0 file's on
    its blocks as stored are those of its dequantized weights."""
    from transformers import AutoModelForCausalLM

    source = tiny_model_factory(arch, **kwargs)
    path = tiny_gguf_factory(arch, "F32", **kwargs)
    expected = _hf_tokens(AutoModelForCausalLM.from_pretrained(source,
                                                               dtype=torch.float32).eval())
    assert _mrv2_tokens(str(path)) == expected
    q8 = str(tiny_gguf_factory(arch, "Q8_0", **kwargs))
    assert _mrv2_tokens(q8, quantization="gguf") == _mrv2_tokens(q8, quantization=None)


# The converter's phi3, smollm3, olmo2, mistral3 and MoE models (and Llama's YaRN keys):
# Phi-3's fused qkv_proj / gate_up_proj written whole, its LongRoPE factors as tensors and
# partial rotary as rope.dimension_count; SmolLM3 permuted like Llama, its NoPE layers
# llama.cpp's fixed every-4th (the source follows it); OLMo 2's norms after the sublayers and
# q/k norms over the whole projection; Ministral 3's query scaling (temperature_scale).
LLAMA_FAMILY_GGUF = {
    "phi3": {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0],
                              "long_factor": [3.0, 3.0, 5.0, 9.0]},
             "max_position_embeddings": 1024,
             "config": {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 256}},
    "smollm3": {"num_layers": 4, "config": {"no_rope_layers": [1, 1, 1, 0]}},
    "olmo2": {"tie_word_embeddings": False},
    "ministral3": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                    "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5,
                                    "original_max_position_embeddings": 8}},
    "llama": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                               "original_max_position_embeddings": 32}},  # YaRN as keys
    # MoE: experts as 3-D tensors, routers F32; renormalisation as llama.cpp fixes it per
    # architecture (the sources follow it; llama.cpp has no dense layers in these), Qwen2-MoE's
    # shared expert, OLMoE's eps as its converter writes it, Mixtral as "llama".
    "qwen3_moe": {"num_layers": 3, "config": {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "norm_topk_prob": True}},
    "qwen2_moe": {"num_layers": 3, "config": {
        "num_experts": 4, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96}},
    # (seed 1: seed 0's greedy tokens reach the EOS id, which transformers' min_new_tokens
    # masks and mrv2's ignore_eos does not)
    "olmoe": {"seed": 1, "config": {"num_experts": 8, "num_experts_per_tok": 4,
                                    "rms_norm_eps": 1e-5}},
    "mixtral": {"config": {"num_local_experts": 4, "num_experts_per_tok": 2}},
}


@pytest.mark.usefixtures("float_activations")
@pytest.mark.parametrize("arch", list(LLAMA_FAMILY_GGUF))
def test_llama_family_gguf_equals_the_safetensors_model(tiny_model_factory, tiny_gguf_factory,
                                                        arch):
    """An F32 file gives the tokens transformers gives on the source checkpoint; a Q8_0 file
    computed on as stored (float32 activations) the tokens of its dequantized weights."""
    _check_gguf_against_source(tiny_model_factory, tiny_gguf_factory, arch,
                               LLAMA_FAMILY_GGUF[arch])
