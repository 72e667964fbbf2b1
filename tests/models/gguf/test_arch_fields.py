"""mrv2.models.gguf.arch_fields: Gemma 4's rope read off its rope_freqs divisors, the MoE
fields as llama.cpp fixes them per architecture, gpt-oss's layer pattern and YaRN. (Whole
files against their source configs, and the refusals of keys mrv2 does not implement, are
test_config.py's.)"""

from __future__ import annotations

import numpy as np
import pytest

from mrv2.models.gguf import open_gguf
from mrv2.models.gguf.arch_fields import gemma4_rope, gpt_oss_fields, moe_fields
from mrv2.models.registry import UnsupportedModelError
from tests.models.gguf.test_config import write_file


def _file(path, arch: str, fields: dict, tensors: dict[str, np.ndarray]):
    return open_gguf(write_file(path, arch, fields, tensors))


def test_gemma4_rotated_share_is_the_count_of_unit_divisors(tmp_path):
    divisors = np.array([1.0] * 4 + [1e30] * 12, np.float32)  # 4 of 16 frequencies rotate
    ckpt = _file(tmp_path / "g4.gguf", "gemma4", {
        "gemma4.attention.key_length": 32, "gemma4.rope.freq_base": 1e6,
        "gemma4.rope.freq_base_swa": 1e4, "gemma4.rope.dimension_count_swa": 8},
        {"rope_freqs.weight": divisors})
    rope = gemma4_rope(ckpt, 16)
    assert rope["full_attention"] == {"rope_type": "proportional", "rope_theta": 1e6,
                                      "partial_rotary_factor": 0.25}
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4,
                                         "partial_rotary_factor": 0.5}


def test_moe_fields_per_architecture(tmp_path):
    tensors = {"token_embd.weight": np.zeros((4, 8), np.float32)}
    counts = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 16}
    qwen3 = _file(tmp_path / "q3.gguf", "qwen3moe",
                  {f"qwen3moe.{k}": v for k, v in counts.items()}, tensors)
    assert moe_fields(qwen3, "qwen3moe") == {
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "moe_intermediate_size": 16, "decoder_sparse_step": 1, "mlp_only_layers": []}
    olmoe = _file(tmp_path / "o.gguf", "olmoe", {f"olmoe.{k}": v for k, v in counts.items()},
                  tensors)
    assert moe_fields(olmoe, "olmoe")["norm_topk_prob"] is False
    mixtral = _file(tmp_path / "m.gguf", "llama", {f"llama.{k}": v for k, v in counts.items()},
                    tensors)
    assert moe_fields(mixtral, "llama") == {"num_local_experts": 8, "num_experts_per_tok": 2}
    sigmoid = _file(tmp_path / "s.gguf", "qwen3moe", {
        **{f"qwen3moe.{k}": v for k, v in counts.items()}, "qwen3moe.expert_gating_func": 2},
        tensors)
    with pytest.raises(UnsupportedModelError, match="expert_gating_func 2"):
        moe_fields(sigmoid, "qwen3moe")
    with pytest.raises(UnsupportedModelError, match="experts in a 'phi3' file"):
        moe_fields(qwen3, "phi3")


@pytest.mark.parametrize("pattern, windowed", [
    (None, [True, False, True, False, True]),  # llama.cpp's default: every 2nd layer global
    (3, [True, True, False, True, True]),
    ([False, True, True, False, False], [False, True, True, False, False])])
def test_gpt_oss_fields(tmp_path, pattern, windowed):
    fields = {"gpt-oss.expert_feed_forward_length": 24}
    if pattern is not None:
        fields["gpt-oss.attention.sliding_window_pattern"] = pattern
    ckpt = _file(tmp_path / "g.gguf", "gpt-oss", fields,
                 {"token_embd.weight": np.zeros((4, 8), np.float32)})
    yarn = {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0}
    got = gpt_oss_fields(ckpt, {"num_hidden_layers": 5, "rope_parameters": yarn})
    assert got == {"intermediate_size": 24, "rope_parameters": {**yarn, "truncate": False},
                   "layer_types": ["sliding_attention" if w else "full_attention"
                                   for w in windowed]}
