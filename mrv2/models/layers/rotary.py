"""Rotary position embedding, Hugging Face "rotate_half" (neox) layout.

The cos/sin tables are precomputed once for every position the engine can see, in float32,
with the same arithmetic as transformers (`inv_freq` from an int64 arange cast to float32,
then `position * inv_freq` in float32), so that fp32 logits match transformers to ~1e-6.

Scalings: linear, llama3, dynamic NTK, YaRN (its attention factor multiplies the tables, as
transformers does) and LongRoPE, each bit-identical to transformers' ROPE_INIT_FUNCTIONS. Two of
them depend on the sequence length in transformers, which recomputes the frequencies as a
sequence grows (re-rotating every earlier key, which a KV cache cannot do). Here the length is
fixed once, at `max_model_len`, as llama.cpp fixes it at its context size: dynamic NTK keeps the
plain frequencies while max_model_len <= max_position_embeddings and takes the base of a
max_model_len sequence beyond; LongRoPE takes its short factors while max_model_len <=
original_max_position_embeddings and its long ones beyond. Both agree with transformers for
every sequence when max_model_len is within the original context. A partial rotary factor
rotates the first `rotary_dim` dimensions of each head and passes the rest through.

Config forms read (both appear in the wild):
- transformers >= 5: `config.rope_parameters = {"rope_type", "rope_theta", "factor", ...}`
  (transformers 5 also aliases `config.rope_scaling` to the same dict and drops the
  `rope_theta` attribute);
- transformers 4.x / old config.json: `config.rope_theta` plus an optional
  `config.rope_scaling = {"type" | "rope_type": ..., "factor": ...}`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from mrv2 import platform
from mrv2.models.layers import rotary_numba
from mrv2.models.layers.norm import RMSNorm
from mrv2.models.layers.numba_rows import float32_cpu_inference

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope",
                        "proportional")
DEFAULT_ROPE_THETA = 10000.0
# The rope parameters mrv2 reads (transformers' names; "type" is the legacy rope_type, and
# llama_4_scaling_beta is read by the model that scales its queries: Ministral 3). A config
# with any other key is refused by name. Multimodal rope (Qwen3.5's `mrope_section`,
# `mrope_interleaved`) splits the frequencies among a token's time, height and width
# positions; a text token's three are equal, so for text it is this rope.
ROPE_PARAMETER_KEYS = frozenset((
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
    "max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
    "mscale", "mscale_all_dim", "attention_factor", "truncate", "long_factor", "short_factor",
    "partial_rotary_factor", "freq_factors", "llama_4_scaling_beta", "mrope_section",
    "mrope_interleaved"))


def rope_parameters_from_config(hf_config: Any, layer_type: str | None = None
                                ) -> dict[str, Any]:
    """A flat dict with at least "rope_type" and "rope_theta", whatever the config's form.
    `layer_type` ("full_attention", "sliding_attention"): that type's parameters where the
    config gives them per layer type (Gemma 3), the one set otherwise; None refuses per-type
    parameters (a model that does not pick per layer)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    # Per-layer-type rope (e.g. {"full_attention": {...}, "sliding_attention": {...}}; a
    # transformers 5 Gemma 3 config may keep flat keys beside them, which it does not read).
    if per_layer_type_rope(params):
        if layer_type is None or layer_type not in params:
            raise ValueError(f"per-layer-type rope parameters are not supported here: "
                             f"{params}")
        params = dict(params[layer_type])
    unknown = sorted(set(params) - ROPE_PARAMETER_KEYS)
    if unknown:
        raise ValueError(f"rope parameters {unknown} are not supported; supported: "
                         f"{', '.join(sorted(ROPE_PARAMETER_KEYS))}")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or DEFAULT_ROPE_THETA
    if (rope_type in ("llama3", "yarn", "longrope")
            and params.get("original_max_position_embeddings") is None):
        params["original_max_position_embeddings"] = (
            getattr(hf_config, "original_max_position_embeddings", None)
            or hf_config.max_position_embeddings)
    if rope_type in ("dynamic", "yarn", "longrope"):
        params["max_position_embeddings"] = hf_config.max_position_embeddings
    # Per-frequency divisors of inv_freq (llama.cpp's `rope_freqs` tensor, how its converter
    # writes Llama 3.1's rope scaling; set on configs read from GGUF files).
    factors = getattr(hf_config, "rope_freq_factors", None)
    if factors is not None:
        params["freq_factors"] = list(factors)
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor",
                                                          None))
    if partial is not None:
        params["partial_rotary_factor"] = float(partial)
    return params


class RotaryInputs(NamedTuple):
    """What the layers' rotary reads for one step (LlamaModel.embed): cos and sin [T, D] of the
    tokens' positions, the local table's where the model has one (Gemma 3's windowed layers),
    and the queries' scale [T, 1] where the model scales them by position (Ministral 3)."""

    cos: torch.Tensor
    sin: torch.Tensor
    local: tuple[torch.Tensor, torch.Tensor] | None = None
    query_scale: torch.Tensor | None = None

    def table(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the local table, or of the global one."""
        return self.local if local else (self.cos, self.sin)


def position_query_scale(positions: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """Llama 4's attention scaling, as Ministral 3 applies it to the rotated queries:
    1 + beta * log(1 + floor(position / original)) [T, 1] in float32 (exactly 1 below
    `original`)."""
    return (1 + beta * torch.log(1 + torch.floor(positions / original)))[:, None]


def per_layer_type_rope(params: dict[str, Any] | None) -> bool:
    """Whether rope parameters are given per layer type (Gemma 3's form)."""
    return any(isinstance((params or {}).get(kind), dict)
               for kind in ("full_attention", "sliding_attention"))


def rotary_dim(head_dim: int, rope_parameters: dict[str, Any]) -> int:
    """The dimensions of a head that rotate (the first ones): all but under a partial rotary
    factor, int(head_dim * factor) as transformers takes it. Proportional RoPE (Gemma 4's
    global layers) rotates the whole head, its partial factor zeroing the high frequencies."""
    if rope_parameters.get("rope_type") == "proportional":
        return head_dim
    dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor={rope_parameters['partial_rotary_factor']} "
                         f"gives {dim} rotary dimensions of a {head_dim}-dim head (an even "
                         f"count, at least 2, expected)")
    return dim


def compute_inv_freq(head_dim: int, rope_parameters: dict[str, Any],
                     max_model_len: int | None = None) -> torch.Tensor:
    """inv_freq [rotary_dim // 2] float32, exactly as transformers' ROPE_INIT_FUNCTIONS for a
    sequence of `max_model_len` tokens (dynamic NTK and LongRoPE read it: module docstring)."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported rope types: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    base = float(rope_parameters.get("rope_theta", DEFAULT_ROPE_THETA))
    dim = rotary_dim(head_dim, rope_parameters)
    if rope_type == "dynamic":
        base = _dynamic_ntk_base(base, dim, rope_parameters, max_model_len)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = 1.0 / (base ** shape)
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_parameters["factor"])
    elif rope_type == "proportional":
        # The first partial_rotary_factor of the angles turn as over the whole head; the
        # rest do not turn (frequency 0: those dimension pairs pass through).
        angles = int(rope_parameters.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[angles:] = 0.0
        inv_freq = inv_freq / float(rope_parameters.get("factor", 1.0))
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(base, dim, rope_parameters)
    elif rope_type == "longrope":
        long = (max_model_len or 0) > rope_parameters["original_max_position_embeddings"]
        key = "long_factor" if long else "short_factor"
        factors = rope_parameters[key]
        if len(factors) != dim // 2:
            raise ValueError(f"longrope {key} has {len(factors)} entries; {dim // 2} expected "
                             f"for {dim} rotary dimensions")
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** shape)
    factors = rope_parameters.get("freq_factors")
    if factors is not None:
        if len(factors) != dim // 2:
            raise ValueError(f"{len(factors)} rope frequency factors for head_dim={dim} "
                             f"({dim // 2} expected)")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq


def attention_factor(rope_parameters: dict[str, Any]) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (1.0 for the other types), as
    transformers computes it."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    given = rope_parameters.get("attention_factor")
    if given is not None:
        return float(given)
    factor = _scaling_factor(rope_parameters)
    if rope_type == "longrope":
        original = rope_parameters["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = (rope_parameters.get("mscale"),
                              rope_parameters.get("mscale_all_dim"))
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _scaling_factor(params: dict[str, Any]) -> float:
    # YaRN and LongRoPE without a `factor`: the context's growth over the original one.
    factor = params.get("factor")
    if factor is None:
        return params["max_position_embeddings"] / params["original_max_position_embeddings"]
    return factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _dynamic_ntk_base(base: float, dim: int, params: dict[str, Any],
                      max_model_len: int | None) -> float:
    # The base transformers computes for a sequence of max(max_model_len, the original
    # context) tokens: unchanged within the original context.
    original = params["max_position_embeddings"]
    seq_len = max(max_model_len or 0, original)
    factor = params["factor"]
    return base * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))


def _yarn_inv_freq(base: float, dim: int, params: dict[str, Any]) -> torch.Tensor:
    # Interpolated (divided by the factor) for long wavelengths, extrapolated (kept) for short
    # ones, a linear ramp between the dimensions that make beta_fast and beta_slow turns over
    # the original context. Operation order as transformers'.
    factor = _scaling_factor(params)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    original = params["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
            + (1.0 / pos_freqs) * extrapolation)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths (low frequencies) are divided by `factor`, short ones kept,
    # and the band in between interpolated smoothly. Python-float / tensor-float32 operation
    # order follows transformers so the result is bitwise identical.
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = ((old_context_len / wavelen - low_freq_factor)
                     / (high_freq_factor - low_freq_factor))
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 head_dim: int) -> torch.Tensor:
    """x [T, N*D], cos/sin [T, R] (R = the rotary dims, <= D) -> rotated x [T, N*D] (same
    dtype as x): each head's first R dims rotated, the rest passed through."""
    if float32_cpu_inference(x, cos, sin):
        return rotary_numba.apply_rotary(x, cos, sin, head_dim)
    shape = x.shape
    x = x.reshape(shape[0], -1, head_dim)
    rot = cos.shape[-1]
    x_rot = x[..., :rot]
    # Same expression order as transformers' apply_rotary_pos_emb.
    out = (x_rot * cos[:, None, :]) + (rotate_half(x_rot) * sin[:, None, :])
    if rot < head_dim:
        out = torch.cat((out, x[..., rot:]), dim=-1)
    return out.reshape(shape)


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    head_dim: int, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H*D], k [T, KV*D] (views of the fused qkv output allowed), cos/sin [T, D] ->
    rotated (q, k); with `q_norm`/`k_norm` (Qwen3), each head is RMS-normalised first.

    CUDA tensors run one fused Triton launch for all of it (rotary_triton.py); elsewhere the
    per-head norms, then `apply_rotary` on each.
    """
    if platform.kernel_impl(q.device, portable_cpu_impl=True) == platform.TRITON:
        from mrv2.models.layers import rotary_triton  # Triton is imported on first use only

        if q_norm is None or k_norm is None:
            return rotary_triton.apply_rotary_qk(q, k, cos, sin, head_dim)
        if cos.shape[-1] < head_dim:  # the fused norm reads the rotary dims only
            q, k = normalize_heads(q, k, q_norm, k_norm, head_dim)
            return rotary_triton.apply_rotary_qk(q, k, cos, sin, head_dim)
        # The fused kernel takes one eps: both norms are built from the config's rms_norm_eps.
        assert q_norm.eps == k_norm.eps, "q_norm and k_norm with different eps"
        return rotary_triton.apply_rotary_qk(q, k, cos, sin, head_dim, q_norm.weight,
                                             k_norm.weight, q_norm.eps)
    if q_norm is not None and k_norm is not None:
        q, k = normalize_heads(q, k, q_norm, k_norm, head_dim)
    return apply_rotary(q, cos, sin, head_dim), apply_rotary(k, cos, sin, head_dim)


def normalize_heads(q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H*D], k [T, KV*D] with each head RMS-normalised. Heads as rows of a 2-D batch:
    the norms' CPU kernel (norm_numba) takes 2-D inputs, and the fused decode stack
    normalises heads with it too (models/cpu/decode.py)."""
    num_tokens = q.shape[0]
    return (q_norm(q.reshape(-1, head_dim)).reshape(num_tokens, -1),
            k_norm(k.reshape(-1, head_dim)).reshape(num_tokens, -1))


class RotaryEmbedding(nn.Module):
    """cos/sin cache [max_position, rotary_dim] (float32, non-persistent buffers), YaRN's and
    LongRoPE's attention factor multiplied in. `max_model_len`: the sequence length the
    length-dependent scalings are fixed at (module docstring); max_position by default."""

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict[str, Any],
                 max_model_len: int | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim={head_dim} must be even")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, rope_parameters)
        self.max_position = max_position
        self.rope_parameters = dict(rope_parameters)
        inv_freq = compute_inv_freq(head_dim, rope_parameters,
                                    max_position if max_model_len is None else max_model_len)
        scale = attention_factor(rope_parameters)
        # Computed on CPU in float32 whatever the default device/dtype is, so the tables
        # do not depend on where the model is built; moved to the buffer device below.
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu").to(torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        device = torch.empty(0).device
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:  # transformers: emb.cos() * attention_scaling, in float32
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)

    def get_cos_sin(self, positions: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for int64 positions [T], cast to the activation dtype
        (transformers also casts cos/sin to the activation dtype before the multiply)."""
        return self.cos_cache[positions].to(dtype), self.sin_cache[positions].to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H*D], k [T, KV*D] -> rotated (q, k)."""
        cos, sin = self.get_cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin, self.head_dim), apply_rotary(k, cos, sin, self.head_dim)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"max_position={self.max_position}, "
                f"rope_type={self.rope_parameters.get('rope_type')}")
