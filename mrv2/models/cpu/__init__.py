"""CPU fast paths, attached to a loaded model from outside its classes.

The model files describe architectures; `attach` (called by the worker on a CPU device, after
the weights are loaded) overrides a few forwards of one loaded Llama-family model:

- loaded from a quantized GGUF file (`ModelConfig.quantization == "gguf"`): its linears, the
  embedding and the LM head compute on the file's blocks (`quantized_weights`);
- a bfloat16 / float16 model (`ModelConfig.cpu_weight_dtype`): the same modules keep 16-bit
  weights and compute in float32, or on the CPU's 16-bit matrix units where it has them
  (`quantized_weights.attach_half_weights`);
- every `LlamaMLP.forward` runs long batches in chunks of rows (`mlp_chunks`); where both
  its projections got bfloat16 weights that this CPU multiplies natively, its gate/up output
  and activation stay in bfloat16 (`native_half_mlp`);
- `LlamaModel.forward` runs decode steps of a few rows as one numba call, token ids to final
  hidden states (`decode`), when the model qualifies: its embedding and projections compute
  on float32 weights or on the quantized blocks attached above, inside that one call, which
  computes the LM head's logits of its rows too, handed to `compute_logits`
  (`decode_logits`); from the rows where a float32 or bfloat16 model's linears move to
  oneDNN, its decode steps run the layers between oneDNN calls instead (`onednn_decode`,
  as `forward_layers`).

What was attached is returned as a `CpuFastPaths`; nothing is cached on the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mrv2.config import ModelConfig
from mrv2.models.cpu import (decode, decode_logits, mlp_chunks, native_half_mlp,
                             quantized_weights)
from mrv2.models.llama import LlamaModel


@dataclass(frozen=True)
class CpuFastPaths:
    mlps: list[mlp_chunks.ChunkedMLP]
    decode: decode.FusedDecode | None  # None: the model does not qualify
    quantized: quantized_weights.QuantizedModules | None = None

    def release_kv_views(self) -> None:
        """Drop the fused stack's cached views of the KV cache (they keep its memory alive),
        so the cache can be freed (Worker.sleep); the next step builds them again."""
        if self.decode is not None:
            self.decode.args = None
            if self.decode.onednn is not None:
                self.decode.onednn.release_kv_views()


def attach(model: nn.Module, model_config: ModelConfig | None = None) -> CpuFastPaths | None:
    """Attach the CPU fast paths to `model` (a model built by `load_model` on the CPU from
    `model_config`, its weights loaded); None for a model without a LlamaModel."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel):
        return None
    quantized = None
    if model_config is not None and model_config.quantization == "gguf":
        quantized = quantized_weights.attach_quantized_weights(model, model_config)
    elif model_config is not None and model_config.cpu_weight_dtype is not None:
        quantized = quantized_weights.attach_half_weights(model, model_config.cpu_weight_dtype)
    mlps = [mlp_chunks.attach_chunked_mlp(layer.mlp, native_half_mlp.native_half_mlp(
        layer.mlp, mlp_chunks.own_forward(layer.mlp))) for layer in inner.layers]
    fused = decode.attach_fused_decode(inner)
    if fused is not None:
        decode_logits.attach_stack_logits(model, fused)
    return CpuFastPaths(mlps, fused, quantized)


__all__ = ["CpuFastPaths", "attach"]
