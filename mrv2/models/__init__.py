"""Model implementations, the architecture registry and the Hugging Face loader."""

from mrv2.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                               Qwen3ForCausalLM)
from mrv2.models.loader import (ModelNotFoundError, iterate_safetensors, load_hf_config,
                                load_model, resolve_dtype)
from mrv2.models.registry import (SUPPORTED_ARCHITECTURES, UnsupportedModelError,
                                  get_model_class)

__all__ = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "ModelNotFoundError",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "get_model_class",
    "iterate_safetensors",
    "load_hf_config",
    "load_model",
    "resolve_dtype",
]
