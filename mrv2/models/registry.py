"""Hugging Face `architectures` name -> mrv2 model class."""

from __future__ import annotations

from torch import nn

from mrv2.models.llama import (LlamaForCausalLM, Ministral3ForCausalLM, MistralForCausalLM,
                               Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                               SmolLM3ForCausalLM)
from mrv2.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from mrv2.models.gemma4 import Gemma4ForCausalLM
from mrv2.models.gpt_oss import GptOssForCausalLM
from mrv2.models.moe import (MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM,
                             Qwen3MoeForCausalLM)
from mrv2.models.olmo2 import Olmo2ForCausalLM
from mrv2.models.qwen3_next import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                                    Qwen3NextForCausalLM)

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)
# Draft heads of speculative decoding (models/eagle3.py): loaded as speculative_config.model
# only, never as the model served.
EAGLE3_HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no mrv2 implementation."""


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in `architectures` (a config lists one)."""
    for arch in architectures or []:
        if arch in _MODELS:
            return _MODELS[arch]
    if any(arch in EAGLE3_HEAD_ARCHITECTURES for arch in architectures or []):
        raise UnsupportedModelError(
            f"model architecture {list(architectures or [])} is an EAGLE-3 draft head: pass it "
            f"as speculative_config={{'method': 'eagle3', 'model': ...}} beside its target")
    raise UnsupportedModelError(
        f"model architecture {list(architectures or [])} is not supported; supported "
        f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
