"""mrv2.models.gguf.checkpoint: single and split files read as one checkpoint; every broken file
is a GGUFError naming the file, raised when the checkpoint is opened."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from mrv2.models.gguf import GGUFError, is_gguf_path, open_gguf
from mrv2.models.gguf.checkpoint import GGUFCheckpoint, split_files


def test_split_checkpoint_reads_as_the_single_file(tiny_gguf_factory):
    single = GGUFCheckpoint(tiny_gguf_factory("llama", "F16"))
    first = tiny_gguf_factory("llama", "F16", num_splits=3)
    assert first.name.endswith("-00001-of-00003.gguf")
    split = GGUFCheckpoint(first)
    assert len(split.files) == 3
    assert split.tensors.keys() == single.tensors.keys()
    for name, record in single.tensors.items():
        assert np.array_equal(split.tensors[name].data, record.data), name
    assert split.architecture == "llama"
    assert split.fields["llama.block_count"] == single.fields["llama.block_count"]
    # Naming a later shard opens the same checkpoint.
    assert GGUFCheckpoint(first.with_name(first.name.replace("00001-of", "00002-of"))
                          ).tensors.keys() == single.tensors.keys()


def test_missing_shard_is_named(tiny_gguf_factory, tmp_path):
    first = tiny_gguf_factory("llama", "F16", num_splits=3)
    for file in split_files(first)[:2]:
        shutil.copy(file, tmp_path / file.name)
    with pytest.raises(GGUFError, match="incomplete.*00003-of-00003"):
        GGUFCheckpoint(tmp_path / first.name)


def test_truncated_file_is_named(tiny_gguf_factory, tmp_path):
    data = tiny_gguf_factory("llama", "Q8_0").read_bytes()
    for keep in (len(data) - 1000, len(data) // 2, 100, 3):
        bad = tmp_path / f"cut-{keep}.gguf"
        bad.write_bytes(data[:keep])
        with pytest.raises(GGUFError, match=f"cut-{keep}.gguf.*(truncated|corrupt)"):
            GGUFCheckpoint(bad)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip file, not GGUF" * 10)
    with pytest.raises(GGUFError, match="model.gguf: not a readable GGUF file"):
        GGUFCheckpoint(bad)
    with pytest.raises(GGUFError, match="does not exist"):
        open_gguf(tmp_path / "missing.gguf")


def test_tensor_type_the_gguf_package_cannot_dequantize(tmp_path):
    path = tmp_path / "ints.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.int32).reshape(8, 8),
                      raw_dtype=gguf.GGMLQuantizationType.I32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"ints.gguf: tensor 'token_embd.weight' has type I32"):
        GGUFCheckpoint(path)


def test_open_gguf_parses_once_until_the_file_changes(tiny_gguf_factory, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf_factory("qwen2", "F16"), path)
    first = open_gguf(path)
    assert open_gguf(str(path)) is first
    shutil.copy(tiny_gguf_factory("llama", "F16"), path)
    again = open_gguf(path)
    assert again is not first and again.architecture == "llama"


def test_is_gguf_path():
    assert is_gguf_path("a/b/Model-Q4_K_M.GGUF") and is_gguf_path(Path("x.gguf"))
    assert not is_gguf_path("org/model") and not is_gguf_path("model.safetensors")
