"""Random checkpoints of newer architectures at W2's size, and their GGUF files (mrv2's writer:
keys and tensors equal llama.cpp's converter's on these architectures), for `mrv2 bench sweep`:

- gemma4: hidden 1024, 16 layers, 16 / 8 heads of 64, every 5th layer global with heads of 128
  and proportional rope, per-layer inputs of 256, the last 6 layers reading earlier layers'
  caches with double-wide MLPs, a 512-token window, tied, vocabulary 2048 (Q8_0, Q4_0, F16);
- qwen3-moe: ~175M parameters, hidden 1024, 8 layers, 16 / 4 heads of 64, 24 experts of 256,
  top-4 renormalised, vocabulary 2048 (Q8_0, Q4_0).

    python bench/w2_models.py /tmp/w2models
"""

from __future__ import annotations

import sys
from pathlib import Path

from mrv2.testing import make_tiny_model
from mrv2.testing.gguf_writer import write_gguf

_GEMMA4_LAYERS = (["sliding_attention"] * 4 + ["full_attention"]) * 3 + ["full_attention"]
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1e6}}
# name -> (make_tiny_model arguments, GGUF types)
MODELS = {
    "gemma4": (dict(arch="gemma4", num_layers=16, num_kv_heads=8, tie_word_embeddings=True,
                    config={"sliding_window": 512, "layer_types": _GEMMA4_LAYERS,
                            "global_head_dim": 128, "hidden_size_per_layer_input": 256,
                            "vocab_size_per_layer_input": 2048, "num_kv_shared_layers": 6,
                            "use_double_wide_mlp": True, "final_logit_softcapping": 30.0,
                            "rope_parameters": _GEMMA4_ROPE}), ("Q8_0", "Q4_0", "F16")),
    "qwen3-moe": (dict(arch="qwen3_moe", num_layers=8, num_kv_heads=4, config={
        "num_experts": 24, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
        "norm_topk_prob": True}), ("Q8_0", "Q4_0")),
}


def main(out: Path) -> None:
    for name, (params, types) in MODELS.items():
        model = make_tiny_model(out / name, seed=0, hidden_size=1024, num_heads=16,
                                head_dim=64, intermediate_size=2816, vocab_size=2048, **params)
        for tensor_type in types:
            path = out / f"{name}-{tensor_type.lower()}.gguf"
            if not path.exists():
                write_gguf(model, path, tensor_type)
            print(path)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/w2models"))
