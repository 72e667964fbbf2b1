"""`--generation-config auto|vllm|FOLDER`: default sampling parameters from a
generation_config.json."""

from __future__ import annotations

import json

import pytest

from mrv2.entrypoints.openai.generation_config import default_sampling_params


def test_auto_reads_sampling_fields_and_vllm_reads_none(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1,
         "max_new_tokens": 64, "do_sample": True, "bos_token_id": 0, "eos_token_id": [1, 2]}))
    assert default_sampling_params(str(tmp_path), "auto") == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
        "repetition_penalty": 1.1, "max_tokens": 64}
    assert default_sampling_params(str(tmp_path), "vllm") == {}


def test_missing_or_broken_files_give_no_defaults(tmp_path):
    assert default_sampling_params(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert default_sampling_params(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot", "top_k": true}')
    assert default_sampling_params(str(tmp_path)) == {}
    with pytest.raises(ValueError, match="generation-config"):
        default_sampling_params(str(tmp_path), "sometimes")  # not a folder


def test_a_folder_path_reads_that_folders_file(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir(), other.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_k": 5}))
    assert default_sampling_params(str(model), str(other)) == {"temperature": 0.2, "top_k": 5}
    # Named explicitly, so a folder without the file or a broken file is an error.
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not"):
        default_sampling_params(str(model), str(tmp_path / "empty"))
    (other / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        default_sampling_params(str(model), str(other))
