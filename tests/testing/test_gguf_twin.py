"""mrv2.testing.gguf_twin: the twin reloads as transformers' own model of the GGUF file."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mrv2.testing.gguf_twin import load_hf_gguf, safetensors_twin, twin_dir


def test_twin_is_transformers_model_of_the_file(tiny_gguf_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("MRV2_CACHE_DIR", str(tmp_path))
    path = tiny_gguf_factory("llama", "Q8_0")
    reference = load_hf_gguf(path)
    twin = safetensors_twin(path, reference)
    assert twin == twin_dir(path) and str(twin).startswith(str(tmp_path))
    assert safetensors_twin(path) == twin  # built once
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 300, 42, 9, 1000]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    tokenizer = AutoTokenizer.from_pretrained(twin)
    gguf_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert tokenizer("hello world").input_ids == gguf_tokenizer("hello world").input_ids
