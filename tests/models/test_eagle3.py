"""The EAGLE-3 head (models/eagle3.py) against EAGLE-3's computation written out in torch, its
checkpoint forms and draft vocabulary, and the target's layer streams (models/llama.py's
aux_hidden_states) against transformers' hidden states."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mrv2.config import ModelConfig
from mrv2.models import load_hf_config, load_model
from mrv2.models.eagle3 import Eagle3LlamaForCausalLM, eagle3_aux_layers
from mrv2.testing.tiny_eagle import make_eagle3_head
from tests.models.test_eagle import BLOCK, _prefill_meta, _rms, _rotate, head_inputs


def _load(path) -> Eagle3LlamaForCausalLM:
    config = ModelConfig(model=str(path), dtype=torch.float32, max_model_len=64,
                         hf_config=load_hf_config(str(path)))
    return load_model(config, torch.device("cpu"), Eagle3LlamaForCausalLM)


def _attention(h, w, p, hf, pos):
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    dim = hf["hidden_size"] // heads
    theta = hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    q = _rotate((h @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, dim), pos, dim, theta)
    k = _rotate((h @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim), pos, dim, theta)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
    k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * dim ** -0.5
    scores = scores.masked_fill(torch.ones_like(scores[0]).triu(1).bool(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(h.shape[0], -1)
    return out @ w[p + "self_attn.o_proj.weight"].T


def reference(path, embeds: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's head over one sequence from position 0 (vLLM's llama_eagle3): fc over the
    three streams; the first layer's attention reads [norm(embeds) | norm(feature)], the
    feature its residual stream; then Llama layers; the stream unnormed."""
    w = load_file(str(path / "model.safetensors"))
    w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
    hf = json.loads((path / "config.json").read_text())
    eps, pos = hf["rms_norm_eps"], torch.arange(embeds.shape[0])
    residual = streams @ w["fc.weight"].T
    x = None
    for i in range(hf["num_hidden_layers"]):
        p = f"layers.{i}."
        if i == 0:
            h = torch.cat((_rms(embeds, w[p + "input_layernorm.weight"], eps),
                           _rms(residual, w[p + "hidden_norm.weight"], eps)), -1)
        else:
            residual = residual + x
            h = _rms(residual, w[p + "input_layernorm.weight"], eps)
        residual = residual + _attention(h, w, p, hf, pos)
        h = _rms(residual, w[p + "post_attention_layernorm.weight"], eps)
        x = (torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
             * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return x + residual


@pytest.mark.parametrize("num_layers", [1, 2])
def test_head_matches_eagle3_written_out(tiny_model_factory, tmp_path, num_layers):
    target = tiny_model_factory("llama")
    path = make_eagle3_head(tmp_path / "head", target, seed=5, num_layers=num_layers)
    head = _load(path)
    embeds, streams, caches = head_inputs(head, 3 * 64)
    n = embeds.shape[0]
    with torch.no_grad():
        out = head(embeds, head.target_features(streams), torch.arange(n), caches,
                   _prefill_meta(n))
    torch.testing.assert_close(out, reference(path, embeds, streams), atol=2e-5, rtol=2e-5)
    assert head.embed_tokens is None  # the target's is used


def test_drafts_map_to_target_ids(tiny_model_factory, tmp_path):
    """A draft vocabulary of 32 tokens (every vocab / 32 th): the head's argmax d is target
    id d + d2t[d];
    `t2d` is not needed; `model.`-prefixed `layers.0.` names load as `midlayer.` ones."""
    target = tiny_model_factory("llama")
    path = make_eagle3_head(tmp_path / "head", target, seed=2, draft_vocab_size=32)
    head = _load(path)
    features = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = head.lm_head.weight @ head.norm(features).T
        step = load_hf_config(str(path)).vocab_size // 32
        assert torch.equal(head.next_tokens(features, None), step * logits.argmax(0))
    tensors = load_file(str(path / "model.safetensors"))
    tensors = {("model." + k.replace("midlayer.", "layers.0.") if k != "lm_head.weight" else k): v
               for k, v in tensors.items() if k not in ("d2t", "t2d")}
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):  # a smaller draft vocabulary needs its map
        _load(path)


def test_default_aux_layers_are_vllms():
    class Config:
        eagle_config = None

    assert eagle3_aux_layers(Config(), 32) == (2, 16, 29)
    Config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 5, 7]}
    assert eagle3_aux_layers(Config(), 32) == (1, 5, 7)


def test_target_streams_match_transformers_hidden_states(tiny_model_factory):
    """The stream entering each listed layer is transformers' hidden_states[layer] (the
    embeddings at 0), concatenated in layer order."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from mrv2.models.cpu import decode as cpu_decode

    target = tiny_model_factory("llama", num_layers=4)
    config = ModelConfig(model=str(target), dtype=torch.float32, max_model_len=64,
                         hf_config=load_hf_config(str(target)))
    model = load_model(dataclasses.replace(config, aux_hidden_state_layers=(0, 1, 3)),
                       torch.device("cpu"))
    assert cpu_decode.supports(model.decoder_spec)
    ids = torch.tensor([3, 17, 42, 5, 99, 7])
    layer = model.model.layers[0].self_attn
    caches = [torch.zeros(2, 4, BLOCK, layer.num_kv_heads, layer.head_dim) for _ in range(4)]
    with torch.no_grad():
        model(ids, torch.arange(len(ids)), caches, _prefill_meta(len(ids)))
        hf = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32)
        states = hf(ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in (0, 1, 3)], -1)
    torch.testing.assert_close(model.model.aux_hidden_states, want, atol=1e-4, rtol=1e-4)


def test_the_fused_stack_outputs_the_module_paths_streams(tiny_model_factory, tmp_path,
                                                          monkeypatch):
    """Every stream a head reads (prefill chunks from the modules, decode and verify steps and
    runs from the fused stack) is the module path's, within float32 rounding."""
    from mrv2 import LLM, SamplingParams
    from mrv2.models.cpu import decode as cpu_decode

    target = tiny_model_factory("llama", num_layers=4)
    head = make_eagle3_head(tmp_path / "head", target, seed=4, aux_layers=[0, 1, 3])
    seen: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    calls = {"n": 0}
    real_features, real_decode = Eagle3LlamaForCausalLM.target_features, cpu_decode.decode_model

    def counted(*args):
        calls["n"] += 1
        return real_decode(*args)

    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for fused in (True, False):
        with monkeypatch.context() as m:
            m.setattr(Eagle3LlamaForCausalLM, "target_features",
                      lambda self, streams, fused=fused: (seen[fused].append(streams.clone()),
                                                          real_features(self, streams))[1])
            m.setattr(cpu_decode, "decode_model", counted)
            if not fused:
                m.setattr(cpu_decode, "applies", lambda *args: False)
            llm = LLM(str(target), max_model_len=128, speculative_config={
                "method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
            llm.generate(prompts, params, use_tqdm=False)
            llm.shutdown()
        if fused:
            assert calls["n"] > 0
    assert len(seen[True]) == len(seen[False]) > 3
    for a, b in zip(seen[True], seen[False]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
