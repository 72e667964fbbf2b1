"""InputProcessor: prompt forms, prompt checks, unsupported sampling parameters, EOS id."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest

from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.input_processor import InputProcessor, PromptError, UnsupportedParameterError
from mrv2.protocol import EngineCoreRequest
from mrv2.sampling_params import SamplingParams

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def config(tiny_llama):
    return EngineArgs(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN,
                      device="cpu").create_engine_config()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def processor(config, tokenizer) -> InputProcessor:
    return InputProcessor(config, tokenizer)


def with_eos(config, eos, model=None):
    """`config` whose hf_config names `eos` (and whose model path is `model`, when given)."""
    hf = copy.deepcopy(config.model_config.hf_config)
    hf.eos_token_id = eos
    model_config = dataclasses.replace(config.model_config, hf_config=hf,
                                       model=config.model_config.model if model is None
                                       else str(model))
    return dataclasses.replace(config, model_config=model_config)


def test_text_prompt(processor, tokenizer):
    params = SamplingParams(max_tokens=3)
    request, text = processor.process("r1", "hello world", params)
    assert isinstance(request, EngineCoreRequest)
    assert text == "hello world"
    assert request.request_id == "r1"
    assert request.prompt_token_ids == tokenizer("hello world").input_ids
    assert request.sampling_params is params
    assert request.eos_token_id == 1
    assert request.arrival_time > 0


def test_token_prompt(processor):
    request, text = processor.process("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams())
    assert text is None
    assert request.prompt_token_ids == [5, 6, 7]
    # Tuples are accepted; the text given alongside token ids is kept, not re-tokenized.
    request, text = processor.process("r", {"prompt_token_ids": (9, 8), "prompt": "ab"},
                                      SamplingParams())
    assert request.prompt_token_ids == [9, 8] and text == "ab"


def test_dict_with_prompt_text(processor, tokenizer):
    request, text = processor.process("r", {"prompt": "hi there"}, SamplingParams())
    assert text == "hi there"
    assert request.prompt_token_ids == tokenizer("hi there").input_ids


@pytest.mark.parametrize("prompt", [
    {"prompt_token_ids": [1, "2"]},
    {"prompt_token_ids": [1.0, 2.0]},
    {"prompt_token_ids": [True, 2]},
    {"prompt_token_ids": "1 2 3"},
    {"prompt_token_ids": b"\x01\x02"},
    {"text": "no known key"},
    {"prompt": 5},
    [1, 2, 3],
    5,
    None,
])
def test_malformed_prompts(processor, prompt):
    with pytest.raises(PromptError):
        processor.process("r", prompt, SamplingParams())


@pytest.mark.parametrize("ids", [5, None])
def test_non_sequence_token_ids_raise_prompt_error(processor, ids):
    with pytest.raises(PromptError):
        processor.process("r", {"prompt_token_ids": ids}, SamplingParams())


@pytest.mark.parametrize("prompt", ["", {"prompt": ""}, {"prompt_token_ids": []}])
def test_empty_prompt(processor, prompt):
    with pytest.raises(PromptError, match="empty"):
        processor.process("r", prompt, SamplingParams())


def test_too_long_prompt_names_both_numbers(processor):
    # max_model_len tokens leave no room to generate: refused.
    with pytest.raises(PromptError) as info:
        processor.process("r", {"prompt_token_ids": [5] * MAX_MODEL_LEN}, SamplingParams())
    assert f"{MAX_MODEL_LEN} tokens" in str(info.value)
    assert f"max_model_len is {MAX_MODEL_LEN}" in str(info.value)
    with pytest.raises(PromptError) as info:
        processor.process("r", {"prompt_token_ids": [5] * 40}, SamplingParams())
    assert "40" in str(info.value) and str(MAX_MODEL_LEN) in str(info.value)
    # One shorter fits.
    processor.process("r", {"prompt_token_ids": [5] * (MAX_MODEL_LEN - 1)}, SamplingParams())


def test_too_long_text_prompt(processor):
    with pytest.raises(PromptError, match="max_model_len"):
        processor.process("r", "word " * 200, SamplingParams())


@pytest.mark.parametrize("bad", [-1, 2048, 10**9])
def test_out_of_vocab_ids(processor, bad):
    with pytest.raises(PromptError, match=rf"token id {bad} is outside the vocabulary \[0, 2048\)"):
        processor.process("r", {"prompt_token_ids": [5, bad, 6]}, SamplingParams())


def test_vocab_edges_accepted(processor):
    request, _ = processor.process("r", {"prompt_token_ids": [0, 2047]}, SamplingParams())
    assert request.prompt_token_ids == [0, 2047]


@pytest.mark.parametrize("field, value", [
    ("logprobs", 0), ("logprobs", 5), ("logprobs", 20), ("prompt_logprobs", 0),
    ("prompt_logprobs", 20),
])
def test_logprobs_accepted(processor, field, value):
    params = SamplingParams(**{field: value})
    request, _ = processor.process("r", "hello", params)
    assert getattr(request.sampling_params, field) == value


@pytest.mark.parametrize("field, value", [
    ("logprobs", 21), ("logprobs", -2), ("prompt_logprobs", 50), ("prompt_logprobs", 1.5),
])
def test_logprobs_out_of_range_refused(processor, field, value):
    with pytest.raises(ValueError, match=rf"{field}.*\[0, 20\]"):
        SamplingParams(**{field: value})
    params = SamplingParams()
    setattr(params, field, value)  # set after construction: the processor checks again
    with pytest.raises(ValueError, match=rf"SamplingParams.{field}={value}.*\[0, 20\]"):
        processor.process("r", "hello", params)


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {2048: 1.0}), ("allowed_token_ids", [1, 2048]), ("stop_token_ids", [4096]),
])
def test_token_ids_outside_the_vocabulary_refused(processor, field, value):
    with pytest.raises(ValueError, match=rf"{field}.*vocabulary size 2048"):
        processor.process("r", "hello", SamplingParams(**{field: value}))


def test_supported_parameters_accepted(processor):
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=3,
                            stop_token_ids=[4], ignore_eos=True, max_tokens=5, min_tokens=2,
                            skip_special_tokens=False, stop=[], logit_bias={3: 1.0},
                            presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.1, allowed_token_ids=[1, 2])
    request, _ = processor.process("r", "hello", params)
    assert request.sampling_params is params
    # n > 1, stop strings and include_stop_str_in_output are handled by the engine front end.
    params = SamplingParams(n=3, stop=["x", "yz"], include_stop_str_in_output=True,
                            spaces_between_special_tokens=False)
    request, _ = processor.process("r", "hello", params)
    assert request.sampling_params is params


def test_stop_strings_need_a_tokenizer(config):
    processor = InputProcessor(config, None)
    with pytest.raises(UnsupportedParameterError, match="stop.*tokenizer.*stop_token_ids"):
        processor.process("r", {"prompt_token_ids": [3]}, SamplingParams(stop=["x"]))
    processor.process("r", {"prompt_token_ids": [3]}, SamplingParams(stop_token_ids=[7]))


def test_params_must_be_sampling_params(processor):
    with pytest.raises(TypeError, match="SamplingParams"):
        processor.process("r", "hello", {"temperature": 0.0})


def test_parameters_checked_before_the_prompt(processor):
    # The bad parameter is reported even for a prompt that is also bad.
    params = SamplingParams()
    params.logprobs = 21
    with pytest.raises(ValueError, match="logprobs"):
        processor.process("r", "", params)


def test_eos_from_config(config, tokenizer):
    assert config.model_config.hf_config.eos_token_id == 1
    assert InputProcessor(config, tokenizer).eos_token_id == 1
    assert InputProcessor(config, tokenizer).eos_stop_token_ids == ()
    assert InputProcessor(config, None).eos_token_id == 1
    # The tokenizer's EOS is the primary one (vLLM); the config's others stop like stop ids.
    processor = InputProcessor(with_eos(config, [5, 6]), tokenizer)
    assert (processor.eos_token_id, processor.eos_stop_token_ids) == (1, (5, 6))
    request, _ = processor.process("r", {"prompt_token_ids": [3]}, SamplingParams())
    assert (request.eos_token_id, request.eos_stop_token_ids) == (1, (5, 6))
    processor = InputProcessor(with_eos(config, [5, 6]), None)
    assert (processor.eos_token_id, processor.eos_stop_token_ids) == (5, (6, 1))


def test_eos_from_generation_config(config, tmp_path):
    """generation_config.json's EOS ids join the config's; without a tokenizer the config's
    first is the primary one. A single-file model (GGUF) has no generation_config.json."""
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [9, 5, 10]}')
    processor = InputProcessor(with_eos(config, 5, tmp_path), None)
    assert (processor.eos_token_id, processor.eos_stop_token_ids) == (5, (9, 10))
    processor = InputProcessor(with_eos(config, None, tmp_path), None)
    assert (processor.eos_token_id, processor.eos_stop_token_ids) == (9, (5, 10))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    processor = InputProcessor(with_eos(config, [3, 4], gguf), None)
    assert (processor.eos_token_id, processor.eos_stop_token_ids) == (3, (4,))


def test_eos_from_tokenizer_when_config_has_none(config, tmp_path):
    fake_tokenizer = SimpleNamespace(eos_token_id=7)
    # tmp_path: a model folder without generation_config.json.
    assert InputProcessor(with_eos(config, None, tmp_path), fake_tokenizer).eos_token_id == 7
    assert InputProcessor(with_eos(config, [], tmp_path), fake_tokenizer).eos_token_id == 7
    assert InputProcessor(with_eos(config, None, tmp_path), None).eos_token_id is None
    request, _ = InputProcessor(with_eos(config, None, tmp_path), None).process(
        "r", {"prompt_token_ids": [3]}, SamplingParams())
    assert request.eos_token_id is None and request.eos_stop_token_ids == ()


def test_text_prompt_without_tokenizer(config):
    processor = InputProcessor(config, None)
    with pytest.raises(PromptError, match="tokenizer"):
        processor.process("r", "hello", SamplingParams())
    with pytest.raises(PromptError, match="tokenizer"):
        processor.process("r", {"prompt": "hello"}, SamplingParams())
    request, text = processor.process("r", {"prompt_token_ids": [3, 4]}, SamplingParams())
    assert request.prompt_token_ids == [3, 4] and text is None
