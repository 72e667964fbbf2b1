"""mrv2/models/generation_config.py: reading generation_config.json, its sampling defaults, and
every EOS id of a model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mrv2.models.generation_config import (GenerationConfigError, eos_token_ids,
                                           read_generation_config, sampling_defaults)


def write(folder, config) -> None:
    (folder / "generation_config.json").write_text(
        config if isinstance(config, str) else json.dumps(config))


def test_read_generation_config(tmp_path):
    assert read_generation_config(tmp_path) == {}  # no file
    assert read_generation_config(None) == {}
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert read_generation_config(gguf) == {}  # a single-file model has none
    write(tmp_path, {"temperature": 0.6, "eos_token_id": [1, 2]})
    assert read_generation_config(tmp_path) == {"temperature": 0.6, "eos_token_id": [1, 2]}
    assert read_generation_config(str(tmp_path), strict=True)["temperature"] == 0.6
    for broken in ("{not json", "[1, 2]"):
        write(tmp_path, broken)
        assert read_generation_config(tmp_path) == {}
        with pytest.raises(GenerationConfigError, match="generation_config.json"):
            read_generation_config(tmp_path, strict=True)
    with pytest.raises(GenerationConfigError, match="unreadable"):
        read_generation_config(tmp_path / "missing", strict=True)


def test_sampling_defaults_maps_vllms_fields():
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_new_tokens": 64, "do_sample": True,
              "eos_token_id": [1, 2], "presence_penalty": 0.3}
    assert sampling_defaults(config) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                         "min_p": 0.05, "repetition_penalty": 1.1,
                                         "max_tokens": 64}
    assert sampling_defaults({"temperature": "hot", "top_k": True, "top_p": None}) == {}


def test_eos_ids_are_the_union_of_config_and_generation_config(tmp_path):
    hf = SimpleNamespace(eos_token_id=[128001, 128008, 128009])
    assert eos_token_ids(hf, tmp_path) == (128001, 128008, 128009)
    write(tmp_path, {"eos_token_id": [128009, 7]})
    assert eos_token_ids(hf, tmp_path) == (128001, 128008, 128009, 7)
    # The tokenizer's EOS comes first: the primary one, as in vLLM.
    assert eos_token_ids(hf, tmp_path, 128009) == (128009, 128001, 128008, 7)
    assert eos_token_ids(SimpleNamespace(eos_token_id=3), tmp_path) == (3, 128009, 7)
    assert eos_token_ids(SimpleNamespace(), tmp_path) == (128009, 7)  # no eos in the config
    write(tmp_path, {"eos_token_id": 5})  # an int, as a list's single entry
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), tmp_path) == (5,)


def test_eos_ids_fall_back_to_the_tokenizer_and_skip_junk(tmp_path):
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), tmp_path) == ()
    assert eos_token_ids(SimpleNamespace(eos_token_id=[]), tmp_path, 7) == (7,)
    write(tmp_path, {"eos_token_id": [True, -1, "2", 4]})
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), tmp_path) == (4,)


def test_eos_ids_of_a_gguf_file_come_from_its_config(tmp_path):
    write(tmp_path, {"eos_token_id": 99})  # next to the file, but not the model's
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert eos_token_ids(SimpleNamespace(eos_token_id=[2, 32000]), gguf) == (2, 32000)
    assert eos_token_ids(SimpleNamespace(eos_token_id=2), str(gguf), 2) == (2,)
