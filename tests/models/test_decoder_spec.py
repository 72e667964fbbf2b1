"""What each model class declares about itself (mrv2/models/decoder_spec.py): built from
tiny configs, Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3 and OLMo 2 carry the spec of the
modules they built (the spec is the contract the CPU's fused paths read instead of the
modules' types). And the rule the
contract replaced patching with, read from the source: nothing in mrv2/ assigns a model's
`forward`, `forward_layers` or `compute_logits` on an object."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from mrv2.config import ModelConfig
from mrv2.models import load_hf_config
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.registry import get_model_class


def _build(tiny_model_factory, arch: str, **overrides):
    """The mrv2 model class of a tiny `arch` checkpoint's config (with `overrides` set on it),
    built with uninitialised weights: the spec is fixed at construction."""
    hf_config = load_hf_config(str(tiny_model_factory(arch)))
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    config = ModelConfig(model="x", dtype=torch.float32, max_model_len=64, hf_config=hf_config)
    return get_model_class(hf_config.architectures)(config)


def _modules_spec(model) -> DecoderSpec:
    """The spec that the built modules themselves show."""
    layers = model.model.layers
    layer = layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    rope_layers = tuple(each.self_attn.use_rope for each in layers)
    whole = attn.q_norm is not None and attn.q_norm.weight.shape[0] > attn.head_dim
    return DecoderSpec(
        qkv_bias=attn.qkv_proj.bias is not None, o_bias=attn.o_proj.bias is not None,
        qk_norm=attn.q_norm is not None and attn.k_norm is not None and not whole,
        mlp_bias=mlp.gate_up_proj.bias is not None and mlp.down_proj.bias is not None,
        activation=model.model_config.hf_config.hidden_act,
        tied_embeddings=model.lm_head is None,
        rope_layers=None if all(rope_layers) else rope_layers,
        qk_norm_over_projection=whole,
        norms_after=not hasattr(layer, "input_layernorm")
        and hasattr(layer, "post_feedforward_layernorm"))


@pytest.mark.parametrize("arch, overrides, expected", [
    ("llama", {}, DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False)),
    ("llama", {"attention_bias": True, "mlp_bias": True},
     DecoderSpec(qkv_bias=True, o_bias=True, qk_norm=False, mlp_bias=True)),
    ("llama", {"tie_word_embeddings": True},
     DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False,
                 tied_embeddings=True)),
    ("mistral", {}, DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False)),
    # Qwen2: q/k/v biases whatever attention_bias says, never an o_proj bias.
    ("qwen2", {}, DecoderSpec(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)),
    ("qwen2", {"attention_bias": True},
     DecoderSpec(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)),
    ("qwen3", {}, DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=True, mlp_bias=False)),
    ("qwen3", {"tie_word_embeddings": True},
     DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=True, mlp_bias=False,
                 tied_embeddings=True)),
    ("phi3", {}, DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False)),
    # SmolLM3: NoPE layers where no_rope_layers says 0.
    ("smollm3", {"no_rope_layers": [1, 0], "tie_word_embeddings": False},
     DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False,
                 rope_layers=(True, False))),
    ("olmo2", {}, DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False,
                              qk_norm_over_projection=True, norms_after=True)),
])
def test_each_class_declares_the_spec_of_the_modules_it_built(tiny_model_factory, arch,
                                                                overrides, expected):
    model = _build(tiny_model_factory, arch, **overrides)
    assert model.decoder_spec == expected
    assert _modules_spec(model) == expected
    assert model.decoder_spec.tied_embeddings == model.tie_word_embeddings


def test_has_biases_is_any_projections_bias():
    none = DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=True, mlp_bias=False)
    assert not none.has_biases
    for field in ("qkv_bias", "o_bias", "mlp_bias"):
        spec = DecoderSpec(**{**dict(qkv_bias=False, o_bias=False, qk_norm=False,
                                     mlp_bias=False), field: True})
        assert spec.has_biases, field


def test_the_spec_is_frozen(tiny_model_factory):
    """Nothing changes a built model's spec: what the fused paths read once stays true."""
    spec = _build(tiny_model_factory, "llama").decoder_spec
    with pytest.raises(AttributeError):
        spec.qkv_bias = True


# --------------------------------------------------------------------------- no patching

MRV2 = Path(__file__).resolve().parents[2] / "mrv2"
# The attributes the CPU fast paths once replaced on a loaded model; they are methods of the
# model classes only (a class body's `forward = ...` binds a name, not an attribute: allowed).
PATCHED_NAMES = frozenset({"forward", "forward_layers", "compute_logits"})


def _assigned(target: ast.expr):
    """The single targets an assignment target binds (through tuples, lists, starred)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _assigned(element)
    elif isinstance(target, ast.Starred):
        yield from _assigned(target.value)
    else:
        yield target


def _patches(tree: ast.AST):
    """(line, what) of each assignment to an attribute in PATCHED_NAMES (`x.forward = f`,
    augmented or annotated too) and each `setattr(x, "forward", f)` /
    `x.__setattr__("forward", f)` with a literal name."""
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                   else [])
        for target in targets:
            for t in _assigned(target):
                if isinstance(t, ast.Attribute) and t.attr in PATCHED_NAMES:
                    yield node.lineno, f"assigns .{t.attr}"
        if isinstance(node, ast.Call):
            f = node.func
            name = (f.id if isinstance(f, ast.Name)
                    else f.attr if isinstance(f, ast.Attribute) else None)
            if name in ("setattr", "__setattr__"):
                for arg in node.args[:2]:
                    if isinstance(arg, ast.Constant) and arg.value in PATCHED_NAMES:
                        yield node.lineno, f"{name}(..., {arg.value!r}, ...)"


def test_the_patch_finder_sees_each_form():
    snippet = """
model.forward = fused
a.b.compute_logits: object = f
x.forward_layers, y = g, 1
setattr(model, "forward", fused)
object.__setattr__(model, "compute_logits", f)
model.__setattr__("forward_layers", g)
model.forward.weight = w  # a sub-attribute: not a replacement
setattr(model, name, f)  # not a literal name
class C:
    forward = staticmethod(f)  # a class body's name
"""
    assert sorted(line for line, _ in _patches(ast.parse(snippet))) == [2, 3, 4, 5, 6, 7]


def test_nothing_in_mrv2_patches_a_models_forward_or_compute_logits():
    sources = sorted(p for p in MRV2.rglob("*.py") if "__pycache__" not in p.parts)
    assert sources
    offenders = [f"{path.relative_to(MRV2.parent)}:{line}: {what}" for path in sources
                 for line, what in _patches(ast.parse(path.read_text(encoding="utf-8")))]
    assert not offenders, ("mrv2/ replaces a model's forward / forward_layers / compute_logits "
                           "(give the module a field its own forward reads, or have the runner "
                           "choose the path):\n  " + "\n  ".join(offenders))
