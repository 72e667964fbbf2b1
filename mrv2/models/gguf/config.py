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
- MoE files (qwen3moe, qwen2moe, olmoe; Mixtral as "llama" with an expert_count) store each
  layer's experts as 3-D tensors (`ffn_gate_exps` ...); norm_topk_prob is not written (llama.cpp
  fixes it per architecture, `_MOE_RENORMALIZE`); every layer is routed (the converter
  writes no dense MLP for them).
- SmolLM3's NoPE layers are not written: llama.cpp fixes every 4th layer NoPE, which is
  SmolLM3Config's default (`no_rope_layer_interval`).
- Gemma 4 writes its layer pattern (`attention.sliding_window_pattern`), its global layers' kv
  heads and its KV-shared layers' double-wide MLPs as per-layer arrays, the windowed layers'
  head size as `key_length_swa`, and its global layers' "proportional" RoPE as a `rope_freqs`
  tensor: divisor 1 for the rotated frequencies, 1e30 (frequency 0) for the rest.
  `attention_k_eq_v` is not written: global layers without an `attn_v` tensor say it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
}
# Mixtral is written as "llama" with experts (an expert_count key).
_MIXTRAL = ("MixtralConfig", "MixtralForCausalLM")
# Whether llama.cpp rescales an architecture's top-k expert weights to sum to 1 (its graph
# fixes it per architecture; an expert_weights_norm key overrides).
_MOE_RENORMALIZE = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "llama": True}
# Architectures whose head_count_kv / feed_forward_length may be per-layer arrays.
_PER_LAYER_ARRAY_ARCHS = ("gemma4",)
# A rope_freqs divisor at least this large stops its frequency (llama.cpp's Gemma 4 writes 1e30).
_STOPPED_FREQUENCY_DIVISOR = 1e29
# Architectures whose rotary may cover part of each head (`rope.dimension_count` < head size).
_PARTIAL_ROTARY_ARCHS = ("phi3",)
# llama.cpp's Gemma conventions the file does not write: every n-th layer global (the others
# windowed), and which size counts as "27B" (its attention scale from hidden / heads).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Gemma 3's windowed layers' rope base where the file has no rope.freq_base_swa (older
# converters): llama.cpp's default.
_GEMMA3_LOCAL_THETA = 10000.0
ROPE_FREQS_TENSOR = "rope_freqs.weight"
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
        long_factor, short_factor = (_f32_vector(ckpt, name, rope_dim // 2)
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


def _f32_vector(ckpt: GGUFCheckpoint, name: str, length: int) -> list[float]:
    """A 1-D tensor of the file (rope factors) as floats, checked to hold `length` values."""
    from gguf.quants import dequantize

    record = ckpt.tensors.get(name)
    if record is None:
        raise GGUFError(f"{ckpt.path}: no {name} tensor")
    values = dequantize(record.data, record.tensor_type).reshape(-1)
    if values.shape[0] != length:
        raise GGUFError(f"{ckpt.path}: {name} has {values.shape[0]} entries, {length} expected")
    return np.asarray(values, dtype=np.float32).tolist()


def _rope_freq_factors(ckpt: GGUFCheckpoint, head_dim: int) -> list[float] | None:
    if ROPE_FREQS_TENSOR not in ckpt.tensors:
        return None
    return _f32_vector(ckpt, ROPE_FREQS_TENSOR, head_dim // 2)


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


def _gemma4_rope(ckpt: GGUFCheckpoint, head_dim: int) -> dict[str, Any]:
    """Gemma 4's rope per layer type: the windowed layers' default rope (rope.freq_base_swa,
    rope.dimension_count_swa), the global layers' "proportional" rope whose rotated share is the
    count of rope_freqs divisors that are 1 (the others stop their frequency)."""
    from gguf import Keys

    sliding: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(ckpt.arch_field(Keys.Rope.FREQ_BASE_SWA, 10000.0))}
    rotated_swa = int(ckpt.arch_field(Keys.Rope.DIMENSION_COUNT_SWA, head_dim))
    if rotated_swa != head_dim:
        sliding["partial_rotary_factor"] = rotated_swa / head_dim
    global_dim = int(ckpt.require(Keys.Attention.KEY_LENGTH))
    full: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(ckpt.arch_field(Keys.Rope.FREQ_BASE, 1e6))}
    rotated = int(ckpt.arch_field(Keys.Rope.DIMENSION_COUNT, global_dim))
    if ROPE_FREQS_TENSOR in ckpt.tensors:
        divisors = _f32_vector(ckpt, ROPE_FREQS_TENSOR, global_dim // 2)
        pairs = sum(1 for d in divisors if d == 1.0)
        if divisors != [1.0] * pairs + divisors[pairs:] or any(
                d < _STOPPED_FREQUENCY_DIVISOR for d in divisors[pairs:]):
            raise UnsupportedModelError(
                f"{ckpt.path}: Gemma 4 rope_freqs other than 1 for the rotated frequencies "
                f"then >= {_STOPPED_FREQUENCY_DIVISOR:g} (proportional rope) are not supported")
        full["rope_type"], rotated = "proportional", 2 * pairs
    if rotated != global_dim:
        full["partial_rotary_factor"] = rotated / global_dim
    return {"sliding_attention": sliding, "full_attention": full}


def _gemma4_fields(ckpt: GGUFCheckpoint, kwargs: dict[str, Any], kv_heads: list[int],
                   ffn: list[int]) -> dict[str, Any]:
    """Gemma 4's config fields from its per-layer keys and the tensors present."""
    from gguf import Keys

    layers, path = kwargs["num_hidden_layers"], ckpt.path
    windowed = ckpt.require(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if not isinstance(windowed, list) or len(windowed) != layers:
        raise GGUFError(f"{path}: attention.sliding_window_pattern must hold one flag per layer")
    first_shared = layers - int(ckpt.arch_field(Keys.Attention.SHARED_KV_LAYERS, 0))

    def one_value(values: list[int], is_windowed: bool, what: str) -> int | None:
        found = {v for v, w in zip(values, windowed) if bool(w) == is_windowed}
        if len(found) > 1:
            raise UnsupportedModelError(f"{path}: {what} differing between layers of one type "
                                        f"are not supported")
        return found.pop() if found else None

    fields: dict[str, Any] = {
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": ckpt.arch_field(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
        "num_kv_shared_layers": layers - first_shared,
        "hidden_size_per_layer_input": int(
            ckpt.arch_field(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP, 0)),
        "enable_moe_block": "blk.0.ffn_gate_inp.weight" in ckpt.tensors,
        "attention_k_eq_v": any(not windowed[i] and f"blk.{i}.attn_v.weight" not in ckpt.tensors
                                for i in range(first_shared)),
        "num_key_value_heads": one_value(kv_heads, True, "head_count_kv") or kv_heads[0],
    }
    if (per_layer := ckpt.tensors.get("per_layer_token_embd.weight")) is not None:
        fields["vocab_size_per_layer_input"] = per_layer.shape[0]
    global_kv = one_value(kv_heads, False, "head_count_kv")
    global_dim = int(ckpt.require(Keys.Attention.KEY_LENGTH))
    value_dims = (ckpt.arch_field(Keys.Attention.VALUE_LENGTH, global_dim),
                  ckpt.arch_field(Keys.Attention.VALUE_LENGTH_SWA, kwargs["head_dim"]))
    if value_dims != (global_dim, kwargs["head_dim"]):
        raise UnsupportedModelError(f"{path}: value lengths {value_dims} other than the key "
                                    f"lengths are not supported")
    # The global layers' own shape, as transformers' per_layer_config (its global_head_dim
    # argument would default to 512, and its kv-head argument applies only with k_eq_v).
    overrides = {"head_dim": global_dim, "num_key_value_heads": global_kv}
    fields["per_layer_config"] = {i: overrides for i in range(layers) if not windowed[i]}
    wide = [ffn[0] if i < first_shared else 2 * ffn[0] for i in range(layers)]
    if len(set(ffn)) > 1 and ffn != wide:
        raise UnsupportedModelError(f"{path}: feed_forward_length {ffn} is neither one width nor "
                                    f"double width in the KV-shared layers")
    fields["use_double_wide_mlp"] = len(set(ffn)) > 1
    return fields


def _moe_fields(ckpt: GGUFCheckpoint, arch: str) -> dict[str, Any]:
    """A MoE file's expert fields as its transformers config names them."""
    from gguf import Keys

    if arch not in _MOE_RENORMALIZE:
        raise UnsupportedModelError(f"{ckpt.path}: experts in a {arch!r} file are not "
                                    f"supported (MoE: {', '.join(_MOE_RENORMALIZE)})")
    gating = ckpt.arch_field(Keys.LLM.EXPERT_GATING_FUNC)
    if gating not in (None, 1):  # gguf.ExpertGatingFuncType.SOFTMAX
        raise UnsupportedModelError(f"{ckpt.path}: expert_gating_func {gating} is not "
                                    f"supported (softmax only)")
    renormalize = bool(ckpt.arch_field(Keys.LLM.EXPERT_WEIGHTS_NORM, _MOE_RENORMALIZE[arch]))
    experts = int(ckpt.require(Keys.LLM.EXPERT_COUNT))
    used = int(ckpt.require(Keys.LLM.EXPERT_USED_COUNT))
    if arch == "llama":  # Mixtral: every layer routed, always renormalised
        if not renormalize:
            raise UnsupportedModelError(f"{ckpt.path}: Mixtral without renormalised expert "
                                        f"weights is not supported")
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    fields: dict[str, Any] = {"num_experts": experts, "num_experts_per_tok": used,
                              "norm_topk_prob": renormalize}
    if arch == "olmoe":
        return fields
    # llama.cpp's qwen MoE files have no dense layers (its tensor map has none for them).
    fields.update(moe_intermediate_size=int(ckpt.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
                  decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(
            ckpt.arch_field(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0))
    return fields


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
    layers = int(ckpt.require(Keys.LLM.BLOCK_COUNT))
    kv_heads = _per_layer_ints(ckpt, Keys.Attention.HEAD_COUNT_KV, layers, heads)
    ffn = _per_layer_ints(ckpt, Keys.LLM.FEED_FORWARD_LENGTH, layers)
    if arch not in _PER_LAYER_ARRAY_ARCHS and (len(set(kv_heads)) > 1 or len(set(ffn)) > 1):
        raise UnsupportedModelError(
            f"{ckpt.path}: per-layer head_count_kv / feed_forward_length are not supported for "
            f"{arch!r} (only for {', '.join(_PER_LAYER_ARRAY_ARCHS)})")
    if arch == "gemma4":  # key_length is the global layers' head size
        head_dim = int(ckpt.require(Keys.Attention.KEY_LENGTH_SWA))
        rope_parameters = _gemma4_rope(ckpt, head_dim)
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
        kwargs.update(_gemma4_fields(ckpt, kwargs, kv_heads, ffn))
    if ckpt.arch_field(Keys.LLM.EXPERT_COUNT):
        kwargs.update(_moe_fields(ckpt, arch))
    config = getattr(transformers, config_class)(**kwargs)
    factors = None if arch == "gemma4" else _rope_freq_factors(ckpt, head_dim)
    if factors is not None:
        config.rope_freq_factors = factors
    name = ckpt.fields.get("general.name")
    if isinstance(name, str):
        config._name_or_path = name
    return config
