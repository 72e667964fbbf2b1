"""mrv2.models.multimodal_text: Gemma 3's and Gemma 4's released multimodal checkpoints serve
their language model: the config becomes the text config, the language model's tensors are
renamed (both name layouts) and the towers' skipped; tokens equal transformers' multimodal
model on text, with tensor parallelism too."""

from __future__ import annotations

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.multimodal_text import text_config, text_weights
from mrv2.testing.tiny_multimodal import make_tiny_multimodal

GEMMA3 = {"num_layers": 3, "tie_word_embeddings": True, "config": {
    "sliding_window": 5, "query_pre_attn_scalar": 16,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}}
GEMMA4 = {"num_layers": 4, "tie_word_embeddings": True, "config": {
    "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"] * 2,
    "global_head_dim": 32, "num_global_key_value_heads": 2, "attention_k_eq_v": True,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 2048,
    "num_kv_shared_layers": 2}}
PROMPTS = [[5, 17, 99, 230, 7, 8, 9, 10, 11, 12, 13], [300, 301, 302]]


def test_text_weights_rename_both_layouts_and_skip_the_towers():
    weights = [("model.language_model.layers.0.mlp.up_proj.weight", 1),
               ("language_model.model.norm.weight", 2), ("language_model.lm_head.weight", 3),
               ("lm_head.weight", 4), ("model.vision_tower.encoder.w", 5),
               ("vision_tower.vision_model.w", 6), ("multi_modal_projector.w", 7),
               ("model.embed_vision.w", 8), ("model.audio_tower.w", 9),
               ("model.embed_audio.w", 10)]
    assert list(text_weights(weights)) == [
        ("model.layers.0.mlp.up_proj.weight", 1), ("model.norm.weight", 2),
        ("lm_head.weight", 3), ("lm_head.weight", 4)]
    with pytest.raises(ValueError, match="'model.something_else.w' is neither"):
        list(text_weights([("model.something_else.w", 0)]))


def test_text_config_takes_the_composite_ids_and_names_the_causal_lm(tiny_model_factory):
    import transformers

    text = transformers.AutoConfig.from_pretrained(tiny_model_factory("gemma3", **GEMMA3))
    composite = transformers.Gemma3Config(text_config=text.to_dict(), eos_token_id=[1, 106])
    composite.architectures = ["Gemma3ForConditionalGeneration"]
    composite.text_config.eos_token_id = None
    config = text_config(composite)
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert config.multimodal_architecture == "Gemma3ForConditionalGeneration"
    assert config.eos_token_id == [1, 106]
    assert config.num_hidden_layers == 3
    assert text_config(text) is text  # a causal LM's config is its own


def _hf_multimodal_greedy(model_dir) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    return [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in PROMPTS]


def _mrv2_greedy(model_dir, **kwargs) -> list[list[int]]:
    llm = LLM(str(model_dir), max_model_len=128, kv_cache_memory_gb=0.02, **kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("float_activations")
@pytest.mark.parametrize("arch, kwargs, layout, tp", [
    ("gemma3", GEMMA3, "v4", 1),  # the layout transformers writes for Gemma 3 and 4.x wrote
    ("gemma4", GEMMA4, "v5", 2),  # transformers 5's, under tensor parallelism
    ("qwen3_5", {"num_layers": 4}, "v5", 1),  # a hybrid model's (Qwen3.5's `model.visual.`)
])
def test_multimodal_checkpoint_serves_its_language_model(tiny_model_factory, tmp_path, arch,
                                                         kwargs, layout, tp):
    model_dir = make_tiny_multimodal(tiny_model_factory(arch, **kwargs), tmp_path / "mm",
                                     layout)
    assert _mrv2_greedy(model_dir, tensor_parallel_size=tp) == _hf_multimodal_greedy(model_dir)
