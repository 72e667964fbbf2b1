"""CPU fast paths for a loaded model, chosen once after its weights are loaded.

`prepare` (called by the worker on a CPU device) does two things, neither of which replaces
anything on the model's modules:

- gives each linear, the embedding and the LM head the weight it computes on where that is
  not the loaded float32 one (`module.packed`, read by the module's own forward): a 16-bit
  copy for a bfloat16 / float16 model (`ModelConfig.cpu_weight_dtype`)
  (`quantized_weights`); a model loaded from a quantized GGUF file
  (`ModelConfig.quantization == "gguf"`) got the file's blocks from `load_model` already;
- builds the fused decode paths (`decode.fused_decode`) for a model whose `decoder_spec` the
  stack supports: the runner asks them first for each step, and they return the step's
  hidden states and logits, or leave the step to the model.

What was prepared is returned as a `CpuFastPaths`; nothing is cached on the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mrv2.config import ModelConfig
from mrv2.models.cpu import decode, quantized_weights


@dataclass(frozen=True)
class CpuFastPaths:
    decode: decode.FusedDecode | None  # None: the model does not qualify
    packed: quantized_weights.PackedModules | None = None

    def release_kv_views(self) -> None:
        """Drop the fused paths' cached views of the KV cache (they keep its memory alive),
        so the cache can be freed (Worker.sleep); the next step builds them again."""
        if self.decode is not None:
            self.decode.release_kv_views()


def prepare(model: nn.Module, model_config: ModelConfig | None = None) -> CpuFastPaths:
    """Pack `model`'s weights as `model_config` asks (a model built by `load_model` on the CPU
    from it, its weights loaded) and build its fused decode paths."""
    packed = None
    if model_config is not None and model_config.quantization == "gguf":
        packed = quantized_weights.packed_modules(model)  # load_model packed them
    elif model_config is not None and model_config.cpu_weight_dtype is not None:
        packed = quantized_weights.pack_16bit_weights(model, model_config.cpu_weight_dtype)
    return CpuFastPaths(decode.fused_decode(model), packed)


__all__ = ["CpuFastPaths", "prepare"]
