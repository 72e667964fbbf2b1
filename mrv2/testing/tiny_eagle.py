"""EAGLE heads for a target model directory (models/eagle.py's and eagle3.py's checkpoint
forms), for tests and benchmarks: random weights, or (EAGLE-1) a "mirror" of a one-layer
target.

A mirror head is the target's layer fed the next token's embedding alone (`fc` = [I | 0]): at
position p it computes what the target computes at p + 1 (rotary attention depends on
relative positions only), except that its keys start at the second token; for a target whose
layer's input norm and final norm weigh 1 and whose embedding rows have unit RMS
(`mirror_ready_target`), its drafts are the target's own tokens wherever the first token's
share of attention does not tip the argmax. The target's LM head scores its output.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mrv2.models.loader import safetensors_files


def _target_tensors(target_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(str(target_dir)):
        tensors.update(load_file(path))
    return tensors


def _layer_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """A Llama layer's tensors (checkpoint names after `layers.N.`) and their shapes."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config.get("head_dim") or hidden // heads
    return {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (heads * dim, hidden),
            "self_attn.k_proj.weight": (kv_heads * dim, hidden),
            "self_attn.v_proj.weight": (kv_heads * dim, hidden),
            "self_attn.o_proj.weight": (hidden, heads * dim),
            "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter)}


def _head_config(target: str | os.PathLike[str]) -> tuple[dict, int]:
    """(A head's config: the target's shape, vocabulary, norms and rope; the target's layer
    count)."""
    from mrv2.models.loader import load_hf_config

    target_config = load_hf_config(str(target))
    config = {key: value for key, value in target_config.to_dict().items()
              if key in ("hidden_size", "intermediate_size", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                         "max_position_embeddings", "rope_parameters", "rope_theta",
                         "rope_scaling", "hidden_act", "attention_bias", "mlp_bias")}
    return config, target_config.num_hidden_layers


def make_eagle_head(path: str | os.PathLike[str], target: str | os.PathLike[str], *,
                    seed: int = 0, num_layers: int = 1, init_scale: float = 1.0,
                    mirror: bool = False) -> Path:
    """Write an EAGLE-1 head for the Llama target `target` (a model directory, or a GGUF file
    for a random head) into `path` (config.json of the target's shape with `num_layers`
    layers, model.safetensors) and return `path`."""
    out = Path(path)
    config, target_layers = _head_config(target)
    hidden = config["hidden_size"]
    config.update(architectures=["LlamaForCausalLM"], model_type="llama",
                  num_hidden_layers=num_layers)
    generator = torch.Generator().manual_seed(seed)
    if mirror:
        if target_layers != 1 or num_layers != 1:
            raise ValueError("a mirror head is one layer, of a one-layer target")
        layer0 = {name.removeprefix("model.layers.0."): t
                  for name, t in _target_tensors(Path(target)).items()
                  if name.startswith("model.layers.0.")}
        fc = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1)
    else:
        fc = torch.randn(hidden, 2 * hidden, generator=generator) * init_scale / (2 * hidden) ** 0.5
    tensors = {"fc.weight": fc}
    for layer in range(num_layers):
        for name, shape in _layer_shapes(config).items():
            if layer == 0 and name == "input_layernorm.weight":
                continue  # EAGLE's first layer has none
            value = layer0[name].clone() if mirror else (
                1.0 + 0.1 * torch.randn(shape, generator=generator) if len(shape) == 1
                else torch.randn(shape, generator=generator) * init_scale / shape[1] ** 0.5)
            tensors[f"layers.{layer}.{name}"] = value.to(torch.float32).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def mirror_ready_target(path: str | os.PathLike[str], target_dir: str | os.PathLike[str]
                        ) -> Path:
    """A copy of the one-layer Llama target at `target_dir` in `path` whose input and final
    norms weigh 1 and whose embedding rows have unit RMS (a mirror head's target)."""
    target_dir, out = Path(target_dir), Path(path)
    config = json.loads((target_dir / "config.json").read_text())
    if config["num_hidden_layers"] != 1 or config.get("tie_word_embeddings"):
        raise ValueError("a mirror head's target is one layer with an LM head of its own")
    tensors = _target_tensors(target_dir)
    for name in ("model.layers.0.input_layernorm.weight", "model.norm.weight"):
        tensors[name] = torch.ones_like(tensors[name])
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    out.mkdir(parents=True, exist_ok=True)
    for item in target_dir.iterdir():
        if item.is_file() and not item.name.endswith((".safetensors", ".json")):
            shutil.copy(item, out / item.name)  # the tokenizer's files
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def make_eagle3_head(path: str | os.PathLike[str], target: str | os.PathLike[str], *,
                     seed: int = 0, num_layers: int = 1, draft_vocab_size: int | None = None,
                     aux_layers: list[int] | None = None, init_scale: float = 1.0,
                     repeater: bool = False) -> Path:
    """Write a random EAGLE-3 head (models/eagle3.py's checkpoint form: `midlayer.*`, `fc`
    over three streams, `d2t` where `draft_vocab_size` is below the vocabulary: every
    `vocab / draft` th token) for the Llama target directory `target` into `path`. With
    `repeater` (a `repeater_target`'s head): `fc` passes the last stream on, the layers add
    nothing and the final norm and LM head are the target's, so it drafts the token at p,
    the repeater's next token, wherever the draft vocabulary holds it."""
    out = Path(path)
    config = _head_config(target)[0]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    draft_vocab = draft_vocab_size or vocab
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                  num_hidden_layers=num_layers, draft_vocab_size=draft_vocab)
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers,
                                  "use_aux_hidden_state": True}
    generator = torch.Generator().manual_seed(seed)

    def random(shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            return 1.0 + 0.1 * torch.randn(shape, generator=generator)
        return torch.randn(shape, generator=generator) * init_scale / shape[1] ** 0.5

    tensors = {"fc.weight": random((hidden, 3 * hidden)), "norm.weight": random((hidden,)),
               "lm_head.weight": random((draft_vocab, hidden))}
    for layer in range(num_layers):
        prefix = "midlayer." if layer == 0 else f"layers.{layer}."
        for name, shape in _layer_shapes(config).items():
            if layer == 0 and name.startswith("self_attn.") and name[10] in "qkv":
                shape = (shape[0], 2 * hidden)  # [embedding | feature]
            tensors[prefix + name] = random(shape)
        if layer == 0:
            tensors[prefix + "hidden_norm.weight"] = random((hidden,))
    targets = torch.arange(draft_vocab) * (vocab // draft_vocab)
    if draft_vocab != vocab:
        tensors["d2t"] = targets - torch.arange(draft_vocab)
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, targets, True)
    if repeater:
        target_tensors = _target_tensors(Path(target))
        tensors["fc.weight"] = torch.cat((torch.zeros(hidden, 2 * hidden), torch.eye(hidden)), 1)
        for name in tensors:
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                tensors[name] = torch.zeros_like(tensors[name])
        tensors["norm.weight"] = target_tensors["model.norm.weight"].clone()
        tensors["lm_head.weight"] = target_tensors["lm_head.weight"][targets].clone()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def repeater_target(path: str | os.PathLike[str], target_dir: str | os.PathLike[str]) -> Path:
    """A copy of the Llama target at `target_dir` in `path` whose layers add nothing to the
    residual stream (o_proj and down_proj zero) and whose LM head is its embedding: its
    greedy output repeats a prompt's last token (nearly always: a random embedding row scores
    highest against itself). An EAGLE-3 head with `repeater=True` drafts that token."""
    target_dir, out = Path(target_dir), Path(path)
    tensors = _target_tensors(target_dir)
    for name in list(tensors):
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"])
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    out.mkdir(parents=True, exist_ok=True)
    for item in target_dir.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors"):
            shutil.copy(item, out / item.name)  # config and tokenizer
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
