from pathlib import Path
from mrv2.testing import make_tiny_model
from mrv2.testing.gguf_writer import write_gguf
types = (["sliding_attention"] * 4 + ["full_attention"]) * 3 + ["full_attention"]
d = make_tiny_model("/tmp/w2models/gemma4", "gemma4", seed=0, hidden_size=1024, num_layers=16,
    num_heads=16, num_kv_heads=8, intermediate_size=2816, vocab_size=2048, head_dim=64,
    tie_word_embeddings=True, config={
        "sliding_window": 512, "layer_types": types, "global_head_dim": 128,
        "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 2048,
        "num_kv_shared_layers": 6, "use_double_wide_mlp": True, "final_logit_softcapping": 30.0,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}})
for t in ("Q8_0", "Q4_0"):
    out = Path(f"/tmp/w2models/gemma4-{t.lower()}.gguf")
    if not out.exists():
        write_gguf(d, out, t)
print("ok")
