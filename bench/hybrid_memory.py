"""A hybrid model's memory per request against a dense model of the same width: Qwen3.5's
shape (transformers' Qwen3_5TextConfig defaults: 32 layers, three linear-attention layers to
one full-attention layer) against the same model with every layer full attention, at several
context lengths, with the worker's own accounting (core/kv_cache_layout.py: the blocks of the
full-attention layers, each recurrent layer's fixed state per slot, float32).

    PYTHONPATH=bench:. .venv/bin/python bench/hybrid_memory.py --output x.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mrv2.core.kv_cache_layout import KVCacheLayout, recurrent_state_shapes

CONTEXTS = (4096, 32768, 131072)
KV_BYTES = 2  # a bfloat16 / float16 KV cache
STATE_BYTES = 4  # recurrent states are float32


def per_request_bytes(hf, context: int) -> dict[str, int]:
    layout = KVCacheLayout.for_model(hf)
    kv_layers = hf.num_hidden_layers - len(layout.recurrent)
    kv = 2 * kv_layers * hf.num_key_value_heads * hf.head_dim * KV_BYTES * context
    conv, memory = recurrent_state_shapes(hf)
    state = len(layout.recurrent) * (math.prod(conv) + math.prod(memory)) * STATE_BYTES
    return {"kv_cache": kv, "recurrent_state": state, "total": kv + state}


def main() -> None:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    hybrid = Qwen3_5TextConfig()
    dense = Qwen3_5TextConfig(layer_types=["full_attention"] * hybrid.num_hidden_layers)
    rows = []
    for context in CONTEXTS:
        h, d = per_request_bytes(hybrid, context), per_request_bytes(dense, context)
        rows.append({"context": context, "hybrid": h, "dense": d,
                     "hybrid_over_dense": h["total"] / d["total"]})
        print(f"{context:>7} tokens: hybrid {h['total'] / 2**20:8.1f} MiB "
              f"(KV {h['kv_cache'] / 2**20:.1f} + state {h['recurrent_state'] / 2**20:.1f}), "
              f"dense {d['total'] / 2**20:8.1f} MiB, ratio {rows[-1]['hybrid_over_dense']:.3f}")
    if args.output:
        args.output.write_text(json.dumps({"shape": "Qwen3_5TextConfig defaults",
                                           "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
