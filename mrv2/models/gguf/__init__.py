"""GGUF checkpoints (llama.cpp's format): config, tokenizer and weights from one file or split.

`open_gguf` parses a checkpoint once per process; `gguf_hf_config`, `gguf_tokenizer` and
`iterate_gguf_weights` turn it into what the safetensors path produces (a transformers config,
a tokenizer, Hugging Face-named tensors), undoing what llama.cpp's converter changed.
"""

from mrv2.models.gguf.checkpoint import GGUFCheckpoint, GGUFError, is_gguf_path, open_gguf
from mrv2.models.gguf.config import GGUF_ARCHITECTURES, gguf_hf_config
from mrv2.models.gguf.tokenizer import gguf_tokenizer, has_tokenizer
from mrv2.models.gguf.weights import (GGUFWeight, bf16_copy_elements, has_compact_linears,
                                      iterate_gguf_weights)

__all__ = ["GGUF_ARCHITECTURES", "GGUFCheckpoint", "GGUFError", "GGUFWeight",
           "bf16_copy_elements", "gguf_hf_config",
           "gguf_tokenizer", "has_compact_linears", "has_tokenizer", "is_gguf_path",
           "iterate_gguf_weights", "open_gguf"]
