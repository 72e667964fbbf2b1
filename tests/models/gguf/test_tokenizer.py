"""mrv2.models.gguf.tokenizer: the tokenizer a GGUF file describes equals the model directory's
own and transformers' GGUF tokenizer; a file without one is refused before the engine starts."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from mrv2.engine.arg_utils import EngineArgs
from mrv2.models.gguf import GGUFError, gguf_tokenizer, has_tokenizer, open_gguf

TEXTS = ["Hello world", "  two leading spaces\n\ttab  ", "def f(x):\n    return x ** 2",
         "I've 1234567 numbers", "héllo wörld"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_equals_the_source_tokenizer(tiny_model_factory, tiny_gguf_factory, arch):
    path = tiny_gguf_factory(arch, "F16")
    tokenizer = gguf_tokenizer(open_gguf(path))
    source = AutoTokenizer.from_pretrained(tiny_model_factory(arch))
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert ids == source(text).input_ids == reference(text).input_ids, text
        assert tokenizer.decode(ids) == source.decode(ids)
    assert tokenizer.eos_token == source.eos_token
    assert tokenizer.chat_template == source.chat_template


def test_builtin_model_tokenizer_matches_transformers():
    from mrv2.models.builtin import builtin_model_path

    from mrv2.testing.gguf_twin import safetensors_twin

    path = builtin_model_path()
    tokenizer = gguf_tokenizer(open_gguf(path))
    # transformers' GGUF tokenizer of the file, as saved in its twin.
    reference = AutoTokenizer.from_pretrained(safetensors_twin(path))
    messages = [{"role": "user", "content": "What is the capital of France? 😀 Ünïcödé"}]
    assert (tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            == reference.apply_chat_template(messages, add_generation_prompt=True,
                                             return_dict=False))
    assert tokenizer.eos_token == "<|im_end|>"


def test_file_without_a_tokenizer_needs_one(tiny_model_factory, tmp_path):
    import gguf

    from mrv2.models.gguf.checkpoint import GGUFCheckpoint

    # The tiny model's tensors with no tokenizer metadata at all.
    source = GGUFCheckpoint(_tiny_file(tiny_model_factory, tmp_path))
    path = tmp_path / "no-tokenizer.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in source.fields.items():
        if key.startswith("llama.") and isinstance(value, int):
            writer.add_uint32(key, value)
        elif key.startswith("llama.") and isinstance(value, float):
            writer.add_float32(key, value)
    for name, record in source.tensors.items():
        writer.add_tensor(name, np.array(record.data), raw_dtype=record.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert not has_tokenizer(open_gguf(path))
    with pytest.raises(GGUFError, match="no-tokenizer.gguf: the file holds no tokenizer"):
        EngineArgs(model=str(path)).create_engine_config()
    with pytest.raises(GGUFError, match="holds no tokenizer.*--tokenizer"):
        gguf_tokenizer(open_gguf(path))
    # A tokenizer directory given explicitly is enough.
    config = EngineArgs(model=str(path), tokenizer=str(tiny_model_factory("llama"))
                        ).create_engine_config()
    assert config.model_config.tokenizer_path == str(tiny_model_factory("llama"))


def _tiny_file(tiny_model_factory, tmp_path):
    from mrv2.testing.gguf_writer import write_gguf

    return write_gguf(tiny_model_factory("llama"), tmp_path / "source.gguf", "F32")[0]


def test_gemma4_vocabulary_adds_no_bos_as_transformers_reads_it(tmp_path):
    """A Gemma 4 file (tokenizer model "gemma4": sentencepiece-style BPE) says add_bos_token
    true, but its chat template writes <bos>: the tokenizer adds none, as transformers' reading
    of the file, and splits text as it does."""
    import gguf

    path = tmp_path / "gemma4-vocab.gguf"
    writer = gguf.GGUFWriter(path, "gemma4")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.NORMAL] * 6)
    writer.add_token_merges(["\u2581 a", "a b", "\u2581a b"])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = gguf_tokenizer(open_gguf(path))
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ("ab a", "a ab b", "ba"):
        assert tokenizer(text).input_ids == reference(text).input_ids, text
    assert tokenizer("ab a").input_ids[0] != 2
    assert tokenizer.eos_token == "<eos>"
