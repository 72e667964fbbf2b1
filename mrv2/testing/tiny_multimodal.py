"""A tiny random-weight multimodal checkpoint around a tiny text model (make_tiny_model's), as
Gemma 3's and Gemma 4's are released: `*ForConditionalGeneration` with a small vision tower
(Gemma 4: its vision config; Gemma 3: SigLIP; Qwen3.5: its own), the language model's weights
those of the text model (its `out_hidden_size` must be the text model's hidden size).
`layout="v4"` writes the tensor names transformers 4.x saved (`language_model.model.`,
`vision_tower.`), which checkpoints on the Hub still carry."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Text architecture -> (composite config class, multimodal model class).
_MULTIMODAL = {"Gemma3ForCausalLM": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
               "Gemma4ForCausalLM": ("Gemma4Config", "Gemma4ForConditionalGeneration"),
               "Qwen3_5ForCausalLM": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
               "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeConfig",
                                         "Qwen3_5MoeForConditionalGeneration")}
_QWEN3_5_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                   "patch_size": 4, "out_hidden_size": 64, "num_position_embeddings": 64}
_VISION = {
    "Gemma3Config": {"model_type": "siglip_vision_model", "hidden_size": 16,
                     "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "image_size": 28, "patch_size": 14},
    "Gemma4Config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                     "patch_size": 4, "position_embedding_size": 64},
    "Qwen3_5Config": _QWEN3_5_VISION,
    "Qwen3_5MoeConfig": _QWEN3_5_VISION,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json")


def _v4_name(name: str) -> str:
    for new, old in (("model.language_model.", "language_model.model."),
                     ("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector."),
                     ("lm_head.", "language_model.lm_head.")):
        if name.startswith(new):
            return old + name[len(new):]
    return name


def make_tiny_multimodal(text_dir: str | Path, dst: str | Path, layout: str = "v5") -> Path:
    """Write at `dst` the multimodal checkpoint whose language model is the text model at
    `text_dir` (its weights, tokenizer and generation config) and whose vision tower is
    random; returns `dst`."""
    import transformers

    if layout not in ("v5", "v4"):
        raise ValueError(f"layout must be 'v5' or 'v4', got {layout!r}")
    text_dir, dst = Path(text_dir), Path(dst)
    text = transformers.AutoConfig.from_pretrained(text_dir)
    config_name, model_name = _MULTIMODAL[text.architectures[0]]
    extra = {"mm_tokens_per_image": 4} if config_name == "Gemma3Config" else {}
    config = getattr(transformers, config_name)(
        text_config=text.to_dict(), vision_config=_VISION[config_name],
        tie_word_embeddings=text.tie_word_embeddings, **extra)
    config.architectures = [model_name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    state = {f"model.language_model.{k[len('model.'):]}" if k.startswith("model.") else k: v
             for k, v in load_file(str(text_dir / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(k.startswith("model.language_model.") for k in missing):
        raise ValueError(f"text weights do not fit {model_name}: {unexpected or missing}")
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    if layout == "v4":
        weights = load_file(str(dst / "model.safetensors"))
        save_file({_v4_name(k): v.contiguous() for k, v in weights.items()},
                  str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        if (text_dir / name).is_file():
            shutil.copy(text_dir / name, dst / name)
    return dst
