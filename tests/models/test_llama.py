"""mrv2's Llama-family model vs transformers fp32, through the paged KV cache.

Each case checks (1) a one-step prefill of three prompts of different lengths and (2) the same
prompts fed as a first chunk, a second chunk (attending to the cached prefix) and single-token
decodes, mixed in one batch with decode rows first: logits of every processed position must
equal transformers' full-sequence logits to 1e-4.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from mrv2.attention import AttentionMetadata
from mrv2.config import ModelConfig
from mrv2.core.kv_cache_layout import layer_kv_shape
from mrv2.models import load_hf_config, load_model
from mrv2.models.llama import LlamaForCausalLM

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 24
PROMPT_LENS = (9, 13, 6)
# Tokens per step per request (sums to PROMPT_LENS): chunk, chunk, then decodes. In step 2
# request 2 is already decoding while 0 and 1 still prefill against their cached prefix.
SCHEDULE = ((4, 3, 1, 1), (6, 5, 1, 1), (3, 1, 1, 1))

CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    # head_dim 32 != hidden / heads (16): the explicit head_dim path.
    "qwen3": ("qwen3", {"head_dim": 32}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    # original_max_position_embeddings=16: wavelengths above 4 tokens are rescaled, so the
    # scaling changes rotations at the positions tested here.
    "llama-llama3-rope": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "llama-sharded": ("llama", {"num_shards": 3}),
    # Phi-3: fused qkv / gate_up checkpoint tensors, half the head rotated, LongRoPE's short
    # factors (max_model_len within the original context).
    "phi3-longrope-partial": ("phi3", {"rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0],
        "long_factor": [3.0, 3.0, 5.0, 9.0]},
        "config": {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 64}}),
    "smollm3-nope": ("smollm3", {"num_layers": 3, "config": {"no_rope_layers": [1, 0, 1]}}),
    "olmo2": ("olmo2", {}),
    # Windows shorter than the prompts: every layer (Mistral), the second only (Qwen2).
    "mistral-window": ("mistral", {"config": {"sliding_window": 5}}),
    "qwen2-window": ("qwen2", {"config": {"use_sliding_window": True, "sliding_window": 3,
                                          "max_window_layers": 1}}),
    # Gemma 2: sandwich norms of 1 + w, scaled embeddings, GeLU, query_pre_attn_scalar,
    # a window on the first layer, attention and final-logit soft caps small enough to bite.
    "gemma2": ("gemma2", {"config": {
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 2.0}}),
    # Gemma 3: q/k norms, the windowed layers' own rope base, linear scaling on the global one.
    "gemma3": ("gemma3", {"config": {
        "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}}),
    # A Gemma 3 config.json as transformers 4 wrote the released ones (rope_theta for the
    # global layers with rope_scaling, rope_local_base_freq for the windowed ones): read by
    # transformers 5 into per-layer-type parameters with the flat keys left beside them.
    "gemma3-v4-config": ("gemma3", {"num_layers": 3, "config": {
        "sliding_window": 5, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}}),
    # Gemma 4: wider global heads (values = keys), proportional rope on them, per-layer
    # inputs, the last two layers reading layers 1's and 2's caches with double-wide MLPs.
    "gemma4": ("gemma4", {"num_layers": 5, "tie_word_embeddings": True, "config": {
        "sliding_window": 5, "layer_types": ["sliding_attention", "sliding_attention",
                                             "full_attention", "sliding_attention",
                                             "full_attention"],
        "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 2048,
        "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
        "final_logit_softcapping": 10.0, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6}}}}),
    # Mixture of experts (layers/moe.py): Qwen3-MoE with renormalised top-2 of 8, a dense
    # mlp-only layer; Qwen2-MoE with top-3 of 16 not renormalised, routed every 2nd layer, a
    # shared expert; Mixtral top-1 of 4 (its checkpoint names); OLMoE top-4 of 8, q/k norms
    # over the projections.
    "qwen3-moe": ("qwen3_moe", {"num_layers": 3, "config": {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "norm_topk_prob": True, "mlp_only_layers": [1]}}),
    "qwen2-moe": ("qwen2_moe", {"num_layers": 3, "config": {
        "num_experts": 16, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96, "decoder_sparse_step": 2}}),
    "mixtral": ("mixtral", {"config": {"num_local_experts": 4, "num_experts_per_tok": 1}}),
    "olmoe": ("olmoe", {"config": {"num_experts": 8, "num_experts_per_tok": 4}}),
    "llama-yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 8}}),
    # Ministral 3: YaRN, and the queries scaled by 1 + beta * log(1 + floor(pos / 4)).
    "ministral3": ("ministral3", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}}),
}


@dataclasses.dataclass
class Case:
    model: LlamaForCausalLM
    model_config: ModelConfig
    prompts: list[torch.Tensor]
    ref_logits: list[torch.Tensor]  # transformers fp32, [len, vocab] per prompt


def _as_v4_gemma3_config(path: Path, tmp: Path) -> Path:
    """A copy of a tiny Gemma 3 checkpoint whose config.json has transformers 4's rope keys."""
    import json
    import shutil

    out = tmp / "gemma3-v4"
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_theta=1e6, rope_local_base_freq=10000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_factory, tmp_path_factory) -> Case:
    arch, kwargs = CASES[request.param]
    path: Path = tiny_model_factory(arch, **kwargs)
    if request.param == "gemma3-v4-config":
        path = _as_v4_gemma3_config(path, tmp_path_factory.mktemp("v4"))
    hf_config = load_hf_config(str(path))
    model_config = ModelConfig(model=str(path), dtype=torch.float32, max_model_len=64,
                               hf_config=hf_config)
    model = load_model(model_config, torch.device("cpu"))
    gen = torch.Generator().manual_seed(len(request.param))
    prompts = [torch.randint(0, hf_config.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = [ref(p[None]).logits[0] for p in prompts]
    return Case(model, model_config, prompts, ref_logits)


def _kv_caches(mc: ModelConfig) -> list[torch.Tensor]:
    """A cache of its own shape per layer that owns one; a KV-shared layer (Gemma 4) gets its
    source's."""
    # Finite garbage: a slot that is read before being written shows up as a mismatch.
    gen = torch.Generator().manual_seed(7)
    sources = mc.kv_cache_layout.layer_source
    owned = {layer: torch.randn(2, NUM_BLOCKS, BLOCK_SIZE,
                                *layer_kv_shape(mc.hf_config, layer), generator=gen)
             for layer in range(mc.num_layers) if sources[layer] == layer}
    return [owned[source] for source in sources]


def _block_tables() -> list[list[int]]:
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    tables = []
    for n in PROMPT_LENS:
        num = -(-n // BLOCK_SIZE)
        tables.append(perm[:num])
        perm = perm[num:]
    return tables


def _step(case: Case, tables: list[list[int]], rows: list[tuple[int, int, int]],
          kv_caches: list[torch.Tensor], num_pad: int = 0) -> list[torch.Tensor]:
    """Run one step; rows = (request, start, num_tokens) with decode rows first. Returns the
    logits per row. `num_pad` trailing padding tokens have slot -1."""
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    for i, (req, start, n) in enumerate(rows):
        p = torch.arange(start, start + n)
        table = torch.tensor(tables[req])
        ids.append(case.prompts[req][start:start + n])
        pos.append(p)
        slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        block_tables[i, :len(table)] = table
    num_actual = qsl[-1]
    ids.append(torch.zeros(num_pad, dtype=torch.int64))
    pos.append(torch.zeros(num_pad, dtype=torch.int64))
    slots.append(torch.full((num_pad,), -1, dtype=torch.int64))
    qsl_np, sl_np = np.array(qsl, dtype=np.int32), np.array(seq_lens, dtype=np.int32)
    num_decodes = 0
    while num_decodes < len(rows) and rows[num_decodes][2] == 1:
        num_decodes += 1
    meta = AttentionMetadata(
        num_actual_tokens=num_actual, num_reqs=len(rows), num_decodes=num_decodes,
        query_start_loc=torch.from_numpy(qsl_np), seq_lens=torch.from_numpy(sl_np),
        block_tables=block_tables, slot_mapping=torch.cat(slots).long(),
        query_start_loc_np=qsl_np, seq_lens_np=sl_np, max_seq_len=int(sl_np.max()))
    # Every layer has a cache tensor of its own here: each KV cache group reads the same
    # block tables.
    num_groups = case.model_config.kv_cache_layout.num_groups
    meta.other_groups = tuple(dataclasses.replace(meta) for _ in range(num_groups - 1))
    with torch.no_grad():
        hidden = case.model(torch.cat(ids), torch.cat(pos), kv_caches, meta)
        assert hidden.shape == (num_actual + num_pad, case.model_config.hf_config.hidden_size)
        logits = case.model.compute_logits(hidden[:num_actual])
    assert logits.dtype == torch.float32
    return list(logits.split([n for _, _, n in rows]))


def _max_diff(case: Case, rows: list[tuple[int, int, int]], out: list[torch.Tensor]) -> float:
    return max((o - case.ref_logits[req][start:start + n]).abs().max().item()
               for (req, start, n), o in zip(rows, out))


def test_prefill_matches_transformers(case: Case) -> None:
    rows = [(req, 0, n) for req, n in enumerate(PROMPT_LENS)]
    out = _step(case, _block_tables(), rows, _kv_caches(case.model_config))
    diff = _max_diff(case, rows, out)
    assert diff <= ATOL, f"max |logit diff| {diff:.2e}"


def test_chunked_prefill_and_decode_match_transformers(case: Case) -> None:
    tables, kv_caches = _block_tables(), _kv_caches(case.model_config)
    done = [0] * len(PROMPT_LENS)
    worst = 0.0
    for step in range(len(SCHEDULE[0])):
        rows = [(req, done[req], SCHEDULE[req][step]) for req in range(len(PROMPT_LENS))]
        rows.sort(key=lambda r: r[2] != 1)  # decode rows (one token) first, order stable
        # Graph-style padding on one step: extra tokens with slot -1 change nothing.
        out = _step(case, tables, rows, kv_caches, num_pad=3 if step == 1 else 0)
        worst = max(worst, _max_diff(case, rows, out))
        for req, _, n in rows:
            done[req] += n
    assert done == list(PROMPT_LENS)
    assert worst <= ATOL, f"max |logit diff| {worst:.2e}"


def test_all_parameters_are_fused_and_loaded(case: Case) -> None:
    names = set(dict(case.model.named_parameters()))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert ("model.layers.0.mlp.experts.gate_up_proj" if case.model.decoder_spec.is_sparse(0)
            else "model.layers.0.mlp.gate_up_proj.weight") in names
    tied = case.model_config.hf_config.tie_word_embeddings
    assert ("lm_head.weight" in names) is not tied
    for name, param in case.model.named_parameters():
        assert torch.isfinite(param).all(), name


def _config_with(tiny_model_factory, arch: str, max_model_len: int, **overrides) -> ModelConfig:
    hf_config = load_hf_config(str(tiny_model_factory(arch)))
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    return ModelConfig(model="x", dtype=torch.float32, max_model_len=max_model_len,
                       hf_config=hf_config)


def test_sliding_windows_per_layer(tiny_model_factory) -> None:
    """Mistral's window on every layer, Qwen2's on the layers past max_window_layers (its
    layer_types), none with use_sliding_window off, a window that covers max_model_len off in
    the kernels; an unknown layer type refused by name."""
    def windows(arch: str, max_model_len: int, **overrides) -> list[int]:
        model = LlamaForCausalLM(_config_with(tiny_model_factory, arch, max_model_len,
                                              **overrides))
        return [layer.self_attn.attn.sliding_window for layer in model.model.layers]

    assert windows("mistral", 8192, sliding_window=4096) == [4096, 4096]
    assert windows("mistral", 4096, sliding_window=4096) == [0, 0]
    assert windows("qwen2", 128, use_sliding_window=True, sliding_window=64,
                   layer_types=["full_attention", "sliding_attention"]) == [0, 64]
    assert windows("qwen2", 128, use_sliding_window=False, sliding_window=64) == [0, 0]
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention'\] are not"):
        windows("qwen2", 128, layer_types=["full_attention", "linear_attention"])


def test_unexpected_checkpoint_tensor_raises(case: Case) -> None:
    with pytest.raises(ValueError, match="no matching parameter"):
        case.model.load_weights([("model.layers.0.mlp.extra.weight", torch.zeros(1))])


def test_query_scaling_is_refused_where_the_architecture_has_none():
    """llama_4_scaling_beta is Ministral 3's: on a Llama config it is refused, not ignored."""
    from types import SimpleNamespace

    from mrv2.models.llama import LlamaForCausalLM, Ministral3ForCausalLM

    hf = SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                          "original_max_position_embeddings": 16,
                                          "llama_4_scaling_beta": 0.1},
                         max_position_embeddings=64)
    with pytest.raises(ValueError, match="llama_4_scaling_beta"):
        LlamaForCausalLM.position_query_scale(object.__new__(LlamaForCausalLM), hf)
    scale = Ministral3ForCausalLM.position_query_scale(object.__new__(Ministral3ForCausalLM), hf)
    assert scale == (0.1, 16)
