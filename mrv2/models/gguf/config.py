"""A GGUF file's metadata as a transformers config, the form the rest of mrv2 reads.

llama.cpp's converter (`convert_hf_to_gguf.py`) writes the Hugging Face hyperparameters under
its own key names (`gguf.Keys`); this maps them back for the architectures mrv2 implements.
What the converter changes on the way, and how it is undone:

- Llama and Mistral are both written as "llama" (a Mistral file's `sliding_window` survives as
  `llama.attention.sliding_window` when the converter wrote one).
- `attention_bias`, `mlp_bias` and `tie_word_embeddings` are not written: they are read off the
  tensors present (a bias tensor; no `output.weight` means the LM head is the embedding).
- Llama 3.1's "llama3" rope scaling is written as a `rope_freqs` tensor of per-frequency
  divisors, not as keys: the divisors become `config.rope_freq_factors`, which the rotary
  embedding applies (mrv2/models/layers/rotary.py). "linear" scaling is written as keys.
- Every end-of-generation id the file names (eos, eot, eom) becomes `eos_token_id`.
- YaRN is written as keys (type, factor, original context, attention factor, betas).
- Phi-3's LongRoPE is written as `rope_factors_long` / `rope_factors_short` tensors with the
  original context length and attention factor as keys; its partial rotary as
  `rope.dimension_count` below the head size. llama.cpp ignores a Phi-3 file's sliding window;
  mrv2 applies it, as transformers does on the checkpoint the file came from.
- Ministral 3 (GGUF "mistral3") writes its query scaling's beta as
  `attention.temperature_scale` and YaRN's mscale_all_dim as `rope.scaling.yarn_log_multiplier`.
- SmolLM3's NoPE layers are not written: llama.cpp fixes every 4th layer NoPE, which is
  SmolLM3Config's default (`no_rope_layer_interval`).
- Gemma 4's per-layer arrays and proportional rope, the MoE files' experts, gpt-oss's
  layer pattern and YaRN, Qwen3-Next / Qwen3.5's delta rule layers (`ssm.*`), recurrent
  layer flags, MTP blocks and rope sections: arch_fields.py. Their partial rotary is
  `rope.dimension_count` below the head size, as Phi-3's.
"""

from __future__ import annotations

from typing import Any

from mrv2.models.gguf.arch_fields import (ROPE_FREQS_TENSOR, delta_net_fields, gemma4_fields,
                                          gemma4_rope, gpt_oss_fields, moe_fields,
                                          trunk_block_count)
from mrv2.models.gguf.checkpoint import GGUFCheckpoint, GGUFError
from mrv2.models.registry import UnsupportedModelError

# GGUF architecture -> (transformers config class, mrv2/HF architecture name).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "mistral3": ("Ministral3Config", "Ministral3ForCausalLM"),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM"),
    "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
# Hybrid decoders with gated delta rule layers (Qwen3-Next, Qwen3.5 dense and MoE).
DELTA_NET_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
# Architectures whose files may lack feed_forward_length (every layer routed to experts).
_OPTIONAL_FFN_ARCHS = ("qwen3next", "qwen35moe")
# Mixtral is written as "llama" with experts (an expert_count key).
_MIXTRAL = ("MixtralConfig", "MixtralForCausalLM")

# Architectures whose head_count_kv / feed_forward_length may be per-layer arrays.
_PER_LAYER_ARRAY_ARCHS = ("gemma4",)

# Architectures whose rotary may cover part of each head (`rope.dimension_count` < head size).
_PARTIAL_ROTARY_ARCHS = ("phi3", *DELTA_NET_ARCHS)
# llama.cpp's Gemma conventions the file does not write: every n-th layer global (the others
# windowed), and which size counts as "27B" (its attention scale from hidden / heads).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Gemma 3's windowed layers' rope base where the file has no rope.freq_base_swa (older
# converters): llama.cpp's default.
_GEMMA3_LOCAL_THETA = 10000.0
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# The rope scaling types of llama.cpp's metadata that mrv2's rotary embedding implements.
_ROPE_SCALING = {"none": "default", "linear": "linear", "yarn": "yarn"}
_EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
             "tokenizer.ggml.eom_token_id")


def _torch_dtype_name(ckpt: GGUFCheckpoint) -> str:
    """The dtype the checkpoint's matrices were stored in, as a config `dtype`: what
    `dtype="auto"` picks on CUDA (quantized files dequantize to float16, as in vLLM)."""
    types = {rec.type_name for rec in ckpt.tensors.values() if len(rec.shape) == 2}
    if types <= {"F32"}:
        return "float32"
    if types <= {"BF16", "F32"}:
        return "bfloat16"
    return "float16"


def end_of_generation_ids(ckpt: GGUFCheckpoint) -> list[int]:
    """Every end-of-generation id the file names, the primary eos first."""
    ids: list[int] = []
    for key in _EOG_KEYS:
        value = ckpt.fields.get(key)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def _rope_parameters(ckpt: GGUFCheckpoint, head_dim: int) -> dict[str, Any]:
    from gguf import Keys

    theta = float(ckpt.arch_field(Keys.Rope.FREQ_BASE, 10000.0))
    rope_dim = ckpt.arch_field(Keys.Rope.DIMENSION_COUNT, head_dim)
    params: dict[str, Any] = {"rope_theta": theta}
    if rope_dim != head_dim:
        if ckpt.architecture not in _PARTIAL_ROTARY_ARCHS or rope_dim > head_dim or rope_dim % 2:
            raise UnsupportedModelError(
                f"{ckpt.path}: rotary dimension {rope_dim} of head_dim {head_dim} is not "
                f"supported for {ckpt.architecture!r} (partial rotary: "
                f"{', '.join(_PARTIAL_ROTARY_ARCHS)})")
        params["partial_rotary_factor"] = rope_dim / head_dim
    if LONGROPE_TENSORS[0] in ckpt.tensors:
        long_factor, short_factor = (ckpt.f32_vector(name, rope_dim // 2)
                                     for name in LONGROPE_TENSORS)
        params.update(rope_type="longrope", long_factor=long_factor, short_factor=short_factor,
                      original_max_position_embeddings=int(
                          ckpt.require(Keys.Rope.SCALING_ORIG_CTX_LEN)))
        if (factor := ckpt.arch_field(Keys.Rope.SCALING_ATTN_FACTOR)) is not None:
            params["attention_factor"] = float(factor)
        return params
    scaling = ckpt.arch_field(Keys.Rope.SCALING_TYPE, "none")
    if scaling not in _ROPE_SCALING:
        raise UnsupportedModelError(
            f"{ckpt.path}: rope scaling type {scaling!r} is not supported; supported: "
            f"{', '.join(_ROPE_SCALING)} (and llama3 rope factors, Phi-3's LongRoPE factors)")
    params["rope_type"] = _ROPE_SCALING[scaling]
    if scaling in ("linear", "yarn"):
        params["factor"] = float(ckpt.require(Keys.Rope.SCALING_FACTOR))
    if scaling == "yarn":
        params.update(_yarn_fields(ckpt))
    return params


def _yarn_fields(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    """YaRN's keys as transformers names them; an extrapolation mix other than 1 (llama.cpp's
    ext_factor, which transformers has not) is refused."""
    from gguf import Keys

    ext = ckpt.arch_field(Keys.Rope.SCALING_YARN_EXT_FACTOR)
    if ext is not None and float(ext) != 1.0:
        raise UnsupportedModelError(f"{ckpt.path}: rope.scaling.yarn_ext_factor={ext} is not "
                                    f"supported (1.0 only)")
    fields: dict[str, Any] = {
        "original_max_position_embeddings": int(ckpt.require(Keys.Rope.SCALING_ORIG_CTX_LEN))}
    if (log_mul := ckpt.arch_field(Keys.Rope.SCALING_YARN_LOG_MUL)) is not None:
        fields["mscale"] = fields["mscale_all_dim"] = float(log_mul)  # Ministral 3's pair
    if (beta := ckpt.arch_field(Keys.Attention.TEMPERATURE_SCALE)) is not None:
        fields["llama_4_scaling_beta"] = float(beta)
    for key, name in ((Keys.Rope.SCALING_YARN_ATTN_FACTOR, "attention_factor"),
                      (Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast"),
                      (Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow")):
        if (value := ckpt.arch_field(key)) is not None:
            fields[name] = float(value)
    return fields


def _rope_freq_factors(ckpt: GGUFCheckpoint, head_dim: int) -> list[float] | None:
    if ROPE_FREQS_TENSOR not in ckpt.tensors:
        return None
    return ckpt.f32_vector(ROPE_FREQS_TENSOR, head_dim // 2)


def _gemma_fields(ckpt: GGUFCheckpoint, arch: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a Gemma file as llama.cpp reads it: its layer pattern, attention
    scale, soft caps and (Gemma 3) the windowed layers' rope."""
    from gguf import Keys

    layers, pattern = kwargs["num_hidden_layers"], _GEMMA_PATTERN[arch]
    big = layers == _GEMMA_27B_LAYERS[arch]
    fields: dict[str, Any] = {
        "layer_types": ["sliding_attention" if i % pattern < pattern - 1 else "full_attention"
                        for i in range(layers)],
        "query_pre_attn_scalar": (kwargs["hidden_size"] // kwargs["num_attention_heads"] if big
                                  else kwargs["head_dim"]),
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": ckpt.arch_field(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
        "attn_logit_softcapping": ckpt.arch_field(Keys.LLM.ATTN_LOGIT_SOFTCAPPING),
    }
    if arch == "gemma3":
        local = float(ckpt.arch_field(Keys.Rope.FREQ_BASE_SWA, _GEMMA3_LOCAL_THETA))
        fields["rope_parameters"] = {"full_attention": kwargs["rope_parameters"],
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": local}}
    return fields


def _per_layer_ints(ckpt: GGUFCheckpoint, key: str, layers: int,
                    default: int | None = None) -> list[int]:
    """A key that is one value or an array of one value per layer, as one value per layer."""
    value = ckpt.require(key) if default is None else ckpt.arch_field(key, default)
    values = ([int(v) for v in value] if isinstance(value, (list, tuple))
              else [int(value)] * layers)
    if len(values) != layers:
        raise GGUFError(f"{ckpt.path}: {key.format(arch=ckpt.architecture)} has {len(values)} "
                        f"entries for {layers} layers")
    return values


def gguf_hf_config(ckpt: GGUFCheckpoint) -> Any:
    """The transformers PretrainedConfig the checkpoint was converted from."""
    import transformers
    from gguf import Keys

    arch = ckpt.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{ckpt.path}: GGUF architecture {arch!r} is not supported; supported GGUF "
            f"architectures: {', '.join(GGUF_ARCHITECTURES)}")
    config_class, architecture = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and ckpt.arch_field(Keys.LLM.EXPERT_COUNT):
        config_class, architecture = _MIXTRAL
    hidden = int(ckpt.require(Keys.LLM.EMBEDDING_LENGTH))
    heads = int(ckpt.require(Keys.Attention.HEAD_COUNT))
    layers = (trunk_block_count(ckpt) if arch in DELTA_NET_ARCHS
              else int(ckpt.require(Keys.LLM.BLOCK_COUNT)))
    kv_heads = _per_layer_ints(ckpt, Keys.Attention.HEAD_COUNT_KV, layers, heads)
    ffn = _per_layer_ints(ckpt, Keys.LLM.FEED_FORWARD_LENGTH, layers,
                          0 if arch in _OPTIONAL_FFN_ARCHS else None)
    if arch not in _PER_LAYER_ARRAY_ARCHS and (len(set(kv_heads)) > 1 or len(set(ffn)) > 1):
        raise UnsupportedModelError(
            f"{ckpt.path}: per-layer head_count_kv / feed_forward_length are not supported for "
            f"{arch!r} (only for {', '.join(_PER_LAYER_ARRAY_ARCHS)})")
    if arch == "gemma4":  # key_length is the global layers' head size
        head_dim = int(ckpt.require(Keys.Attention.KEY_LENGTH_SWA))
        rope_parameters = gemma4_rope(ckpt, head_dim)
    else:
        head_dim = int(ckpt.arch_field(Keys.Attention.KEY_LENGTH, hidden // heads))
        rope_parameters = _rope_parameters(ckpt, head_dim)
    embed = ckpt.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{ckpt.path}: no token_embd.weight tensor")
    tensor_names = ckpt.tensors.keys()
    eos = end_of_generation_ids(ckpt)
    kwargs: dict[str, Any] = dict(
        architectures=[architecture],
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=ffn[0],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads[0],
        head_dim=head_dim,
        max_position_embeddings=int(ckpt.require(Keys.LLM.CONTEXT_LENGTH)),
        rms_norm_eps=float(ckpt.arch_field(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        # The embedding's rows, not llama.vocab_size: the weights decide what can be looked up.
        vocab_size=embed.shape[0],
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=ckpt.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos if len(eos) > 1 else (eos[0] if eos else None),
        pad_token_id=ckpt.fields.get("tokenizer.ggml.padding_token_id"),
        dtype=_torch_dtype_name(ckpt),
    )
    if arch != "qwen2":  # Qwen2 always has q/k/v biases and no attention_bias switch
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch in ("llama", "smollm3"):
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    rope = kwargs["rope_parameters"]
    if "partial_rotary_factor" in rope:
        kwargs["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if rope.get("rope_type") == "longrope":
        kwargs["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    window = ckpt.arch_field(Keys.Attention.SLIDING_WINDOW)
    if window:
        kwargs["sliding_window"] = int(window)
    elif arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    if arch in _GEMMA_PATTERN:
        kwargs.update(_gemma_fields(ckpt, arch, kwargs))
    if arch == "gemma4":
        kwargs.update(gemma4_fields(ckpt, kwargs, kv_heads, ffn))
    if ckpt.arch_field(Keys.LLM.EXPERT_COUNT):
        kwargs.update(moe_fields(ckpt, arch))
    if arch == "gpt-oss":
        kwargs.update(gpt_oss_fields(ckpt, kwargs))
    if arch in DELTA_NET_ARCHS:
        kwargs.update(delta_net_fields(ckpt, kwargs))
        if not kwargs["intermediate_size"]:  # no feed_forward_length: the config's default
            del kwargs["intermediate_size"]
    config = getattr(transformers, config_class)(**kwargs)
    factors = None if arch == "gemma4" else _rope_freq_factors(ckpt, head_dim)
    if factors is not None:
        config.rope_freq_factors = factors
    name = ckpt.fields.get("general.name")
    if isinstance(name, str):
        config._name_or_path = name
    return config
