"""What a decoder-only model declares about itself for the fast paths that read it.

A model class sets `decoder_spec` when it is built; mrv2/models/cpu runs its fused decode
stack for a model whose spec it supports (`decode.supports`) and the module path otherwise.
Nothing is inferred from the modules' types or replaced on them: the spec is the contract.

The module layout a spec promises is the Llama family's: `model.embed_tokens`,
`model.layers[i]` with `input_layernorm` (before attention; OLMo 2's `norms_after` layers have
none and a `post_feedforward_layernorm` instead), `self_attn` (`qkv_proj`, `o_proj`, optional
`q_norm` / `k_norm`, `attn`), `post_attention_layernorm`, `mlp` (a layers.mlp `GatedMLP`),
then `model.norm`, `model.rotary_emb`, and `lm_head` unless the embeddings are tied.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts model's feed-forward (layers/moe.py): `sparse_layers[i]` says
    whether layer i routes to experts (else it has the dense MLP of `intermediate_size`)."""
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights rescaled to sum to 1
    sparse_layers: tuple[bool, ...]
    shared_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert (0: none)
    # gpt-oss: a bias on the router and on each expert's two projections, the experts' own
    # activation (None: DecoderSpec.activation) with its keyword arguments, and the
    # checkpoint's layout of the 3-D expert tensors (load only: layers/moe.EXPERT_LAYOUTS).
    # Each default is what the other MoE models do: code that computes only those can
    # refuse the rest by comparing the fields with their defaults.
    router_bias: bool = False
    expert_bias: bool = False
    activation: str | None = None
    activation_kwargs: tuple[tuple[str, float], ...] = ()
    checkpoint_layout: str = "stacked"


@dataclass(frozen=True)
class DecoderSpec:
    qkv_bias: bool  # q/k/v projections have a bias
    o_bias: bool  # the attention output projection has a bias
    qk_norm: bool  # per-head RMSNorm of q and k before rotary (Qwen3)
    mlp_bias: bool  # the MLP's projections have biases
    activation: str = "silu"  # the gated MLP's activation
    tied_embeddings: bool = False  # the LM head multiplies by the embedding's table
    # Layers that rotate q and k (SmolLM3's NoPE layers do not); None: every layer.
    rope_layers: tuple[bool, ...] | None = None
    # OLMo 2: RMSNorm over the whole q and k projections (not per head) before rotary, and
    # each sublayer's output normalised before it joins the residual stream (no norm before).
    qk_norm_over_projection: bool = False
    norms_after: bool = False
    # Each layer's sliding window (0: every key); None: no layer has one.
    sliding_windows: tuple[int, ...] | None = None
    # Gemma: norms multiply by 1 + w (in float32), the embeddings are scaled (by
    # sqrt(hidden), rounded to the activation dtype), attention scores by attention_scale
    # (None: head_dim ** -0.5), and the windowed layers rotate with their own rope parameters
    # (`local_rope`: Gemma 3's "sliding_attention" ones).
    norm_unit_offset: bool = False
    # Gemma: norms before and after each sublayer (input, post-attention, pre- and
    # post-feedforward), the normalised outputs joining the residual stream.
    sandwich_norms: bool = False
    embedding_scale: float | None = None
    attention_scale: float | None = None
    local_rope: bool = False
    # Gemma 2: scores and final logits soft-capped, tanh(x / cap) * cap (None: not).
    attention_softcap: float | None = None
    logit_softcap: float | None = None
    # Ministral 3 (Llama 4's attention scaling): (beta, original) scales the rotated queries
    # by 1 + beta * log(1 + floor(position / original)); None: not.
    position_query_scale: tuple[float, int] | None = None
    # Gemma 4: values RMS-normalised per head (no weight), layers whose own heads may be
    # wider (`per_layer_config`), per-layer input embeddings of this width (0: none) and layers
    # that reuse an earlier layer's keys and values (each layer's source; None: none).
    value_norm: bool = False
    per_layer_input_size: int = 0
    kv_sources: tuple[int, ...] | None = None
    # Mixture of experts (None: every layer's MLP is dense). The fused decode stack does not
    # run routed layers (cpu/decode.supports).
    moe: MoESpec | None = None
    # gpt-oss: each attention head's learned sink logit (attention/backend.Attention's
    # `sinks`), one more logit in its softmax with no value.
    attention_sinks: bool = False
    # Qwen3-Next / Qwen3.5 (qwen3_next.py): the layers whose token mixer is a gated delta rule
    # with a per-slot recurrent state instead of attention (None: none), and full attention
    # whose output is gated per head by sigmoid of a second half of the q projection. The fused
    # decode stack runs neither (cpu/decode.supports).
    linear_attention: tuple[bool, ...] | None = None
    attention_output_gate: bool = False
    # An EAGLE-3 head's target (ModelConfig.aux_hidden_state_layers): the layers whose input
    # stream the model also outputs (LlamaModel.aux_hidden_states; the fused decode stack's
    # `aux`; not onednn_decode's layers, which such a target does not run).
    aux_hidden_layers: tuple[int, ...] = ()

    def is_linear_attention(self, layer: int) -> bool:
        return self.linear_attention is not None and self.linear_attention[layer]

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward routes to experts."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def has_biases(self) -> bool:
        return self.qkv_bias or self.o_bias or self.mlp_bias

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    def window(self, layer: int) -> int:
        return 0 if self.sliding_windows is None else self.sliding_windows[layer]
