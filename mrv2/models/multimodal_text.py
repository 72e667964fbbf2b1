"""The language model inside a multimodal checkpoint, served as text: Gemma 3's, Gemma 4's and
Qwen3.5's released checkpoints are `*ForConditionalGeneration` (a vision tower, Gemma 4's an
audio tower too, around a causal LM). mrv2 runs their language model on text prompts, as vLLM
does with no image or audio in the request; it has no vision or audio encoder, so the towers'
weights are not loaded (a request carrying an image or audio part is refused where requests are
read).

The composite config becomes its `text_config` (the causal LM's architecture, the token ids and
dtype the composite carries where the text config has none; `multimodal_architecture` names the
checkpoint's own), and `text_weights` renames the language model's tensors to the causal LM's
names (both transformers 5's `model.language_model.` layout and 4.x's `language_model.` one
still on the Hub) and leaves the towers' out."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

# Multimodal architecture -> the causal LM of its language model.
TEXT_MODELS: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
# The language model's tensors in those checkpoints -> the causal LM's names.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
# The vision and audio towers and their projections into the text stream: not loaded.
_TOWER_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "model.embed_vision.",
                   "model.audio_tower.", "model.embed_audio.", "vision_tower.",
                   "multi_modal_projector.", "model.visual.", "visual.")
# Fields of the composite config the text config takes where it has none of its own.
_INHERITED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "dtype",
                     "tie_word_embeddings")


def text_config(config: Any) -> Any:
    """The causal LM's config of a multimodal checkpoint's config (one of TEXT_MODELS); any
    other config as it is."""
    architecture = next((a for a in getattr(config, "architectures", None) or []
                         if a in TEXT_MODELS), None)
    if architecture is None:
        return config
    text = config.get_text_config()
    for field in _INHERITED_FIELDS:
        if getattr(text, field, None) is None and getattr(config, field, None) is not None:
            setattr(text, field, getattr(config, field))
    text.architectures = [TEXT_MODELS[architecture]]
    text.multimodal_architecture = architecture
    text._name_or_path = config._name_or_path
    return text


def text_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A multimodal checkpoint's language-model tensors under the causal LM's names; the
    towers' are skipped; any other name is an error (as an unknown safetensors name is)."""
    for name, tensor in weights:
        if name.startswith(_TOWER_PREFIXES):
            continue
        renamed = next((new + name[len(old):] for old, new in _TEXT_PREFIXES
                        if name.startswith(old)), None)
        if renamed is None:
            raise ValueError(f"checkpoint tensor {name!r} is neither the language model's nor "
                             f"a vision / audio tower's")
        yield renamed, tensor
