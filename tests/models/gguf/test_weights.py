"""mrv2.models.gguf.weights: the file's tensors come back as the Hugging Face tensors they were
converted from (names mapped back, llama's q/k permutation undone), whole or by rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mrv2.models.gguf import GGUFError, gguf_hf_config, iterate_gguf_weights, open_gguf
from mrv2.models.gguf.checkpoint import GGUFCheckpoint
from mrv2.models.gguf.weights import GGUFWeight, unpermute_rows
from mrv2.models.layers.linear import materialize, narrow


def _source_tensors(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_f32_file_gives_back_every_source_tensor(tiny_model_factory, tiny_gguf_factory, arch):
    source = _source_tensors(tiny_model_factory(arch))
    ckpt = open_gguf(tiny_gguf_factory(arch, "F32"))
    got = {name: materialize(weight)
           for name, weight in iterate_gguf_weights(ckpt, gguf_hf_config(ckpt))}
    assert got.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(got[name], tensor.float()), name


def test_quantized_rows_equal_the_rows_of_the_whole(tiny_gguf_factory):
    ckpt = open_gguf(tiny_gguf_factory("llama", "Q8_0"))
    weights = dict(iterate_gguf_weights(ckpt, gguf_hf_config(ckpt)))
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.self_attn.k_proj.weight", "model.embed_tokens.weight"):
        weight = weights[name]
        whole = materialize(weight)
        assert list(whole.shape) == weight.get_shape()
        rows = whole.shape[0]
        for start, size in ((0, rows // 2), (rows // 2, rows - rows // 2), (8, 16)):
            torch.testing.assert_close(materialize(narrow(weight, 0, start, size)),
                                       whole[start:start + size], rtol=0, atol=0)
        cols = whole.shape[1]
        torch.testing.assert_close(materialize(narrow(weight, 1, cols // 2, cols // 2)),
                                   whole[:, cols // 2:], rtol=0, atol=0)


def test_quantized_weights_are_close_to_the_source(tiny_model_factory, tiny_gguf_factory):
    source = _source_tensors(tiny_model_factory("llama"))
    ckpt = open_gguf(tiny_gguf_factory("llama", "Q8_0"))
    for name, weight in iterate_gguf_weights(ckpt, gguf_hf_config(ckpt)):
        expected = source[name].float()
        error = (materialize(weight) - expected).norm() / expected.norm()
        assert error < 0.01, name  # Q8_0: ~0.5% relative error; a misplaced row is ~140%


def test_unpermute_inverts_the_converter_permutation():
    from mrv2.testing.gguf_writer import permute

    for heads, kv_heads in ((4, 4), (4, 2)):
        rows = torch.randn(kv_heads * 16, 8)
        permuted = permute(rows, heads, kv_heads).numpy()
        assert not np.array_equal(permuted, rows.numpy())
        assert np.array_equal(unpermute_rows(permuted, kv_heads), rows.numpy())


def test_tensor_without_a_counterpart_is_named(tiny_gguf_factory):
    ckpt = GGUFCheckpoint(tiny_gguf_factory("llama", "F16"))
    record = ckpt.tensors["token_embd.weight"]
    ckpt.tensors["blk.0.ssm_conv1d.weight"] = record
    with pytest.raises(GGUFError, match="'blk.0.ssm_conv1d.weight' has no counterpart"):
        list(iterate_gguf_weights(ckpt, gguf_hf_config(ckpt)))


def test_weight_keeps_the_stored_blocks(tiny_gguf_factory):
    ckpt = open_gguf(tiny_gguf_factory("qwen2", "Q8_0"))
    weight = dict(iterate_gguf_weights(ckpt, gguf_hf_config(ckpt)))[
        "model.layers.0.mlp.down_proj.weight"]
    assert isinstance(weight, GGUFWeight)
    assert weight.record.type_name == "Q8_0" and weight.record.data.dtype == np.uint8


@pytest.mark.parametrize("tensor_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_every_writable_type_loads_by_rows(tiny_model_factory, tiny_gguf_factory, tensor_type):
    """Each block layout: a rank's rows equal the same rows of the whole tensor, and the whole
    is within the type's error of the source."""
    source = _source_tensors(tiny_model_factory("qwen2"))
    ckpt = open_gguf(tiny_gguf_factory("qwen2", tensor_type))
    weights = dict(iterate_gguf_weights(ckpt, gguf_hf_config(ckpt)))
    weight = weights["model.layers.1.mlp.up_proj.weight"]
    assert weight.record.type_name == tensor_type
    whole = materialize(weight)
    rows = whole.shape[0] // 2
    assert torch.equal(materialize(narrow(weight, 0, rows, rows)), whole[rows:])
    expected = source["model.layers.1.mlp.up_proj.weight"].float()
    assert (whole - expected).norm() / expected.norm() < 0.15


def test_each_tensors_pages_are_released_once_the_next_is_asked_for(tiny_gguf_factory,
                                                                    monkeypatch):
    """Issue 48: the loader copies each tensor before it asks for the next, so the file's
    pages of that tensor are dropped then (GGUFTensorRecord.release_pages), not held in the
    RSS beside the copy."""
    from mrv2.models.gguf.checkpoint import GGUFTensorRecord

    released: list[str] = []
    monkeypatch.setattr(GGUFTensorRecord, "release_pages",
                        lambda record: released.append(record.name))
    ckpt = open_gguf(tiny_gguf_factory("llama", "Q8_0"))
    names = []
    for _, weight in iterate_gguf_weights(ckpt, gguf_hf_config(ckpt)):
        assert released == names  # the previous ones, not this one
        names.append(weight.record.name)
    assert released == names and len(names) > 1
