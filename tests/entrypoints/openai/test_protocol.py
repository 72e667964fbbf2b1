"""Request bodies -> SamplingParams: defaults, vLLM's extra fields, refusals by name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage,
                                              CompletionRequest)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_completion_sampling_params_openai_and_extra_fields():
    request = CompletionRequest.model_validate(
        {"prompt": "x", "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 3, "stop": "END",
         "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"7": 500},
         "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [9],
         "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False,
         "include_stop_str_in_output": True, "allowed_token_ids": [1, 2, 7], "logprobs": 2})
    params = request.to_sampling_params(max_tokens=10)
    assert (params.temperature, params.top_p, params.n, params.seed) == (0.5, 0.9, 2, 3)
    assert params.stop == ["END"] and params.stop_token_ids == [9]
    assert params.logit_bias == {7: 100.0}  # clamped to OpenAI's range
    assert (params.top_k, params.min_p, params.repetition_penalty) == (4, 0.1, 1.2)
    assert params.ignore_eos and params.min_tokens == 2 and not params.skip_special_tokens
    assert params.include_stop_str_in_output and params.allowed_token_ids == [1, 2, 7]
    assert params.logprobs == 2 and params.prompt_logprobs is None and params.max_tokens == 10
    echo = CompletionRequest.model_validate({"prompt": "x", "echo": True, "logprobs": 1})
    assert echo.to_sampling_params(5).prompt_logprobs == 1


def test_defaults_apply_only_to_unset_fields():
    defaults = {"temperature": 0.3, "top_k": 7, "repetition_penalty": 1.1}
    unset = CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params(4, defaults)
    assert (unset.temperature, unset.top_k, unset.repetition_penalty) == (0.3, 7, 1.1)
    given = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "top_k": 0})
    params = given.to_sampling_params(4, defaults)
    assert (params.temperature, params.top_k) == (0, 0)
    plain = CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params(4)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_null_fields_mean_their_defaults():
    """OpenAI's schema allows null for optional fields, and SDKs send it: null is unset."""
    nulls = {name: None for name in ("n", "stream", "temperature", "top_p", "seed", "stop",
                                     "max_tokens", "logprobs", "ignore_eos", "min_tokens",
                                     "echo", "user", "stream_options")}
    request = CompletionRequest.model_validate({"prompt": "x", **nulls})
    assert request == CompletionRequest.model_validate({"prompt": "x"})
    chat = ChatCompletionRequest.model_validate(
        {**CHAT, "n": None, "stream": None, "max_completion_tokens": None, "top_logprobs": None,
         "logprobs": None, "temperature": None})
    assert chat == ChatCompletionRequest.model_validate(CHAT)


def test_unknown_fields_are_logged_and_ignored(caplog):
    """vLLM's rule: a field the server does not know is ignored, with a warning naming it."""
    with caplog.at_level("WARNING", logger="mrv2.entrypoints.openai.protocol_base"):
        request = CompletionRequest.model_validate({"prompt": "x", "unknown": None,
                                                    "stream_options": None, "zzz": {"a": 1}})
        chat = ChatCompletionRequest.model_validate(
            {**CHAT, "response_format": {"type": "text", "newer": 1}})
    assert request == CompletionRequest.model_validate({"prompt": "x"})
    assert not request.model_extra and not chat.response_format.model_extra
    assert "['unknown', 'zzz']" in caplog.text and "['newer']" in caplog.text


def test_chat_logprobs_and_max_completion_tokens():
    request = ChatCompletionRequest.model_validate(
        {**CHAT, "logprobs": True, "top_logprobs": 3, "max_tokens": 9,
         "max_completion_tokens": 4})
    assert request.requested_max_tokens() == 4
    assert request.to_sampling_params(4).logprobs == 3
    assert ChatCompletionRequest.model_validate({**CHAT, "logprobs": True}) \
        .to_sampling_params(4).logprobs == 0
    assert ChatCompletionRequest.model_validate(CHAT).to_sampling_params(4).logprobs is None
    assert ChatCompletionRequest.model_validate(CHAT).requested_max_tokens() is None
    parts = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]},
                      {"role": "assistant", "content": None, "name": "bot"}]})
    assert [m.to_template_dict() for m in parts.messages] == [
        {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "", "name": "bot"}]


@pytest.mark.parametrize("body", [
    {"prompt": "x", "n": 0}, {"prompt": "x", "n": 10**6},
    {"prompt": "x", "seed": 2**64}, {"prompt": "x", "temperature": float("nan")},
    {"prompt": [1, "a"]}, {"prompt": [True]}, {"prompt": [-1]},
    {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "logprobs": 21},
    {"prompt": "x", "stop_token_ids": [-1]},
])
def test_invalid_completion_bodies(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
])
def test_completion_refusals_name_the_field(body, param):
    with pytest.raises(BadRequest) as info:
        CompletionRequest.model_validate(body).check()
    assert info.value.param == param


@pytest.mark.parametrize("extra, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": [{"function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_chat_refusals_name_the_field(extra, param):
    with pytest.raises(BadRequest) as info:
        ChatCompletionRequest.model_validate({**CHAT, **extra}).check()
    assert info.value.param == param
    ok = ChatCompletionRequest.model_validate({**CHAT, "response_format": {"type": "text"},
                                               "tool_choice": "none", "user": "u"})
    ok.check()


def test_bad_logit_bias_and_values_are_errors():
    with pytest.raises(BadRequest):
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"a": 1}}) \
            .to_sampling_params(4)
    with pytest.raises(ValueError, match="temperature"):
        CompletionRequest.model_validate({"prompt": "x", "temperature": -1}) \
            .to_sampling_params(4)
    with pytest.raises(ValueError, match="min_tokens"):
        CompletionRequest.model_validate({"prompt": "x", "min_tokens": 9}).to_sampling_params(4)


def test_tool_history_reaches_the_template_with_parsed_arguments():
    """An assistant turn's tool_calls (arguments a JSON string, as OpenAI sends them) and the
    tool's answer: the template sees the arguments as an object (vLLM does the same)."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}
    assistant = ChatMessage.model_validate({"role": "assistant", "content": None,
                                            "tool_calls": [call]}).to_template_dict()
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    tool = ChatMessage.model_validate({"role": "tool", "tool_call_id": "c1",
                                       "content": "sunny"}).to_template_dict()
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    bad = dict(call, function={"name": "f", "arguments": "not json"})
    kept = ChatMessage.model_validate({"role": "assistant", "tool_calls": [bad]})
    assert kept.to_template_dict()["tool_calls"][0]["function"]["arguments"] == "not json"

