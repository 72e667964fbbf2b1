"""Seeded random-weight models in Hugging Face format, for tests and the demo.

``make_tiny_model`` writes a directory that ``transformers.AutoModelForCausalLM`` and
``AutoTokenizer`` load offline: ``config.json``, ``generation_config.json``, float32 safetensors
(optionally sharded, with ``model.safetensors.index.json``), the tokenizer files and
``mrv2_tiny.json`` (the build parameters, written last: its presence marks a complete build).

Weights are re-initialised from per-tensor seeded generators, so a build depends only on its
parameters. Scales are chosen so that hidden states keep unit RMS, attention and MLP outputs are
comparable to the residual stream (context matters, so attention bugs change greedy output), and
final logits have a std of ~3 across the vocab (top-2 near-ties are rare, so greedy decoding can be
compared token for token with transformers). RMSNorm weights are 1 + 0.1*N(0,1) and qwen2's q/k/v
biases are non-zero, so a skipped norm weight or bias changes the output.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mrv2.testing.tokenizer import (BOS_TOKEN, DEFAULT_VOCAB_SIZE, EOS_TOKEN, PAD_TOKEN,
                                    copy_tokenizer, make_temp_dir, publish_dir, tokenizer_key)
from mrv2.utils.disk_cache import cache_root

# arch -> (config class, model class), both looked up in `transformers` when building.
_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
# The hybrid archs' recurrent layers at a tiny model's scale (`config` overrides each), and
# their released pattern of three linear-attention layers to one of full attention (the last
# layer always full: transformers' cache needs one attention layer).
_HYBRID_FIELDS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32)
SUPPORTED_ARCHS: tuple[str, ...] = tuple(_ARCHS)

MANIFEST = "mrv2_tiny.json"
_MODEL_FILES_VERSION = 1  # bump when the files written for the same parameters change
LOGIT_STD = 3.0      # target std of the final logits across the vocab
NORM_STD = 0.1       # RMSNorm weights ~ 1 + NORM_STD * N(0, 1)
BIAS_STD = 0.2       # q/k/v biases (qwen2): a dropped bias shows; larger ones flatten attention
EMBED_STD = 0.5      # untied token embeddings
RESID_GAIN = 1.5     # extra gain of o_proj / down_proj over 1/sqrt(fan_in)
TIED_EMBED_GAIN = 0.5  # tied embeddings: std = TIED_EMBED_GAIN / sqrt(hidden)


def _tensor_seed(seed: int, name: str) -> int:
    # Per-tensor streams: a tensor's values depend on (seed, name) only, not on iteration order.
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _init_weights(model: torch.nn.Module, seed: int, init_scale: float, tied: bool) -> None:
    hidden = model.config.hidden_size
    # gpt-oss holds its experts transposed, [E, in, out]: the fan-in is dim 1.
    expert_fan_in = 1 if model.config.model_type == "gpt_oss" else 2
    # A tied embedding doubles as the lm_head, and the current token's embedding in the residual
    # then votes for itself (greedy output collapses into repeats). Keep it small and get the
    # logit scale from the final norm's weight instead, as real tied checkpoints do.
    embed_std = TIED_EMBED_GAIN / math.sqrt(hidden) if tied else EMBED_STD
    final_norm_gain = LOGIT_STD / TIED_EMBED_GAIN if tied else 1.0
    with torch.no_grad():
        # named_parameters() de-duplicates, so a tied lm_head is initialised once, as embed_tokens.
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(_tensor_seed(seed, name))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.dim() == 1 and name.endswith("norm.weight"):
                gain = final_norm_gain if name == "model.norm.weight" else 1.0
                value = gain * (1.0 + NORM_STD * noise)
            elif name.endswith((".bias", "_bias")):  # gpt-oss's experts' [E, out] too
                value = BIAS_STD * noise
            elif name.endswith(".sinks"):  # gpt-oss's per-head sink logits, as the scores'
                value = noise
            elif name.endswith(".A_log"):  # a delta rule's decay rates, A in [1, 4)
                value = torch.log(1.0 + 1.5 * (noise.clamp(-1, 1) + 1.0))
            elif name.endswith("embed_tokens.weight"):
                value = embed_std * noise
            elif name == "lm_head.weight":
                value = noise * (LOGIT_STD / math.sqrt(hidden))  # input is unit-RMS after norm
            elif p.dim() == 3:  # a MoE layer's experts [E, out, in], each as a 2-D weight
                gain = RESID_GAIN if name.endswith("down_proj") else 1.0
                value = noise * (gain * init_scale / math.sqrt(p.shape[expert_fan_in]))
            elif p.dim() == 2:
                # 1/sqrt(fan_in) keeps unit gain; the residual-writing projections get more so
                # that attention/MLP outputs dominate the token embedding (context matters).
                gain = RESID_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                value = noise * (gain * init_scale / math.sqrt(p.shape[1]))
            else:
                raise RuntimeError(f"no init rule for parameter {name} {tuple(p.shape)}")
            p.copy_(value)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, loaded
                g = torch.Generator().manual_seed(_tensor_seed(seed, name))
                b.copy_(1.0 + NORM_STD * torch.randn(b.shape, generator=g))


def _split_shards(sizes: list[int], num_shards: int) -> list[int]:
    """Shard index per tensor: contiguous, balanced by bytes, exactly ``num_shards`` non-empty."""
    total, acc, shard, out = sum(sizes), 0, 0, []
    for i, size in enumerate(sizes):
        still_needed = num_shards - 1 - shard
        if out and still_needed > 0 and (acc >= total * (shard + 1) / num_shards
                                         or len(sizes) - i <= still_needed):
            shard += 1
        out.append(shard)
        acc += size
    return out


# Mixtral's Hub names for its MoE block and its experts' projections.
_MIXTRAL_HUB = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _hub_expert_layout(state: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory experts ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) as
    the Hub's checkpoints hold them, one tensor per expert and projection (what save_pretrained
    writes, and llama.cpp's converter reads); Mixtral's under its own names. gpt-oss's Hub
    checkpoints hold transformers' 3-D tensors as they are."""
    if arch == "gpt_oss":
        return state
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if not prefix or leaf not in ("gate_up_proj", "down_proj"):
            out[name] = tensor
            continue
        halves = (("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",))
        for expert in range(tensor.shape[0]):
            for i, part in enumerate(tensor[expert].chunk(len(halves), dim=0)):
                out[f"{prefix}.experts.{expert}.{halves[i]}.weight"] = part.contiguous()
    if arch != "mixtral":
        return out
    renamed = {}
    for name, tensor in out.items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        for hub, mixtral in _MIXTRAL_HUB.items():
            name = name.replace(f".{hub}.", f".{mixtral}.")
        renamed[name] = tensor
    return renamed


def _save_weights(state: dict[str, torch.Tensor], dst: Path, num_shards: int) -> None:
    meta = {"format": "pt"}  # what transformers' save_pretrained writes
    if num_shards == 1:
        save_file(state, str(dst / "model.safetensors"), metadata=meta)
        return
    names = list(state)
    if num_shards > len(names):
        raise ValueError(f"num_shards={num_shards} exceeds the number of tensors ({len(names)})")
    index = _split_shards([state[n].numel() * state[n].element_size() for n in names], num_shards)
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    for i, fname in enumerate(files):
        save_file({n: state[n] for n, s in zip(names, index) if s == i}, str(dst / fname),
                  metadata=meta)
    total = sum(t.numel() * t.element_size() for t in state.values())
    weight_map = {n: files[s] for n, s in zip(names, index)}
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _build(dst: Path, p: dict[str, Any]) -> None:
    import transformers  # heavy; only needed when actually building

    config_cls, model_cls = (getattr(transformers, n) for n in _ARCHS[p["arch"]])
    tok = copy_tokenizer(dst, p["tokenizer_vocab_size"],
                         model_max_length=p["max_position_embeddings"],
                         qwen2_pipeline=p["arch"] in ("qwen2", "qwen3_5_moe"))
    if tok.get_vocab_size() > p["vocab_size"]:
        raise ValueError(f"vocab_size {p['vocab_size']} < tokenizer vocab {tok.get_vocab_size()}")
    ids = {k: tok.token_to_id(t) for k, t in
           (("bos_token_id", BOS_TOKEN), ("eos_token_id", EOS_TOKEN), ("pad_token_id", PAD_TOKEN))}
    fields = dict(
        vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"], num_hidden_layers=p["num_layers"],
        num_attention_heads=p["num_heads"], num_key_value_heads=p["num_kv_heads"],
        head_dim=p["head_dim"],  # explicit: Qwen3Config would otherwise default to 128
        max_position_embeddings=p["max_position_embeddings"], rms_norm_eps=1e-6,
        tie_word_embeddings=p["tie_word_embeddings"], rope_parameters=dict(p["rope_parameters"]),
        architectures=[model_cls.__name__], dtype="float32", **ids,
    )
    if p["arch"] in ("mistral", "ministral3"):
        fields["sliding_window"] = None
    if p["arch"] == "gemma4":  # per layer type: transformers' defaults unless `config` gives
        del fields["rope_parameters"]
    if p["arch"] in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        hybrid = {k: v for k, v in _HYBRID_FIELDS.items()  # the dense one has no experts
                  if p["arch"] != "qwen3_5" or not ("expert" in k or k.startswith("moe"))}
        fields.update(hybrid, layer_types=[
            "full_attention" if (i + 1) % 4 == 0 or i == p["num_layers"] - 1
            else "linear_attention" for i in range(p["num_layers"])])  # one at least
        fields["rope_parameters"].setdefault("partial_rotary_factor", 0.25)
    fields.update(p.get("config") or {})
    config = config_cls(**fields)
    # fork_rng: the caller's global RNG state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p["seed"])
        model = model_cls(config).to(torch.float32).eval()
    _init_weights(model, p["seed"], p["init_scale"], p["tie_word_embeddings"])
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if p["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)  # as save_pretrained does: the loader re-ties it
    _save_weights(_hub_expert_layout(state, p["arch"]), dst, p["num_shards"])
    for f in dst.glob("*.safetensors"):
        f.chmod(0o644)  # safetensors writes 0600; cached models may be shared between users
    config.save_pretrained(dst)
    transformers.GenerationConfig(**ids).save_pretrained(dst)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _publish(tmp: Path, path: Path, manifest: dict[str, Any], overwrite: bool) -> None:
    for _ in range(5):
        if publish_dir(tmp, path):
            return
        if not overwrite and _read_manifest(path) == manifest:
            return  # a concurrent builder won with the same parameters: keep theirs
        # Stale build (or overwrite): move it aside atomically, then retry the rename.
        trash = path.with_name(f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            pass  # someone else moved it already
        shutil.rmtree(trash, ignore_errors=True)
        overwrite = False  # the old dir is gone; an identical concurrent build is now fine
    raise RuntimeError(f"could not publish {path}: it keeps being replaced concurrently")


def make_tiny_model(
    path: str | os.PathLike[str], arch: str = "llama", *, seed: int = 0, hidden_size: int = 64,
    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
    intermediate_size: int = 128, vocab_size: int | None = None,
    tokenizer_vocab_size: int = DEFAULT_VOCAB_SIZE, max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False, rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None, num_shards: int = 1, init_scale: float = 1.0,
    config: dict[str, Any] | None = None, overwrite: bool = False,
) -> Path:
    """Build (or reuse) a random-weight HF model directory at ``path`` and return it.

    ``vocab_size=None`` uses the tokenizer's vocab rounded up to a multiple of 64. ``rope_scaling``
    is an HF rope dict (e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``); it is saved merged
    with ``rope_theta`` as ``rope_parameters`` (the transformers 5 key). ``init_scale`` multiplies
    the 1/sqrt(fan_in) std of the projection weights. ``config``: more fields of the
    architecture's transformers config (``partial_rotary_factor``, ``no_rope_layers``, ...). A
    directory already holding a build with the
    same parameters is returned as is unless ``overwrite``; a non-empty directory that is not an
    mrv2 build raises FileExistsError unless ``overwrite``.
    """
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
        head_dim = hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    tok_key = tokenizer_key(tokenizer_vocab_size)
    if vocab_size is None:
        vocab_size = -(-tokenizer_vocab_size // 64) * 64
    elif vocab_size < tokenizer_vocab_size:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer vocab {tokenizer_vocab_size}")
    # Ministral 3's rope is YaRN with its query-scaling beta (transformers reads both): its
    # released shape, scaled down to a tiny model's context.
    default_rope = ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "llama_4_scaling_beta": 0.1} if arch == "ministral3" else {})
    rope = dict(rope_scaling or default_rope)
    if "type" in rope:  # legacy spelling of rope_type
        rope.setdefault("rope_type", rope.pop("type"))
    rope_parameters = {"rope_type": "default", **rope, "rope_theta": float(rope_theta)}
    params: dict[str, Any] = dict(
        arch=arch, seed=seed, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        vocab_size=vocab_size, tokenizer_vocab_size=tokenizer_vocab_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_parameters, num_shards=num_shards, init_scale=float(init_scale),
        **({"config": dict(config)} if config else {}),  # absent: older manifests hold
    )
    # Round-trip through JSON so the comparison with a manifest read from disk is exact.
    manifest = json.loads(json.dumps({
        "format": _MODEL_FILES_VERSION, "params": params, "tokenizer": tok_key,
        "transformers": importlib.metadata.version("transformers"),
    }))
    out = Path(path).absolute()
    if not overwrite:
        existing = _read_manifest(out)
        if existing == manifest:
            return out  # fast path: complete build with identical parameters
        if existing is None and out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"{out} exists and is not an mrv2 tiny model "
                                  f"(use overwrite=True)")
    tmp = make_temp_dir(out)
    try:
        _build(tmp, params)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _publish(tmp, out, manifest, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_demo_model_path() -> Path:
    """The built-in demo model (llama, hidden 256, 4 layers, 8 heads / 4 kv heads), built on first
    use under ``$MRV2_CACHE_DIR/models/``."""
    return make_tiny_model(cache_root() / "models" / "demo-llama", "llama", seed=0, hidden_size=256,
                           num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688)
