"""Tool calling and structured outputs through the official `openai` client against
`mrv2 serve` (random weights: the grammar guarantees the shapes)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.entrypoints.openai.conftest import API_KEY, MODEL_NAME

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Oslo", "Bergen", "Tromsø"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"]}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def ask(client, seed: int, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=seed,
                                          temperature=1.0, max_tokens=120, **kwargs)


def streamed_calls(client, seed: int, **kwargs) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in ask(client, seed, stream=True, **kwargs):
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_required(client, seed):
    response = ask(client, seed, tools=TOOLS, tool_choice="required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls and all(c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMS[name])
    assert streamed_calls(client, seed, tools=TOOLS, tool_choice="required") == (
        calls, "tool_calls")


@pytest.mark.parametrize("seed", range(2))
def test_named_tool_choice(client, seed):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = ask(client, seed, tools=TOOLS, tool_choice=named).choices[0]
    assert choice.finish_reason == "stop"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert streamed_calls(client, seed, tools=TOOLS, tool_choice=named) == (
        [("get_weather", call.function.arguments)], "stop")


def test_auto_tool_choice_without_a_call_is_content(client):
    choice = ask(client, 0, tools=TOOLS, max_completion_tokens=8).choices[0]
    assert choice.message.tool_calls == [] and choice.finish_reason == "length"
    assert choice.message.content


def test_response_format_json_schema_stream_and_whole_agree(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                                  "strict": True}}
    text = ask(client, 5, response_format=fmt).choices[0].message.content
    jsonschema.validate(json.loads(text), WEATHER)
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in ask(client, 5, response_format=fmt, stream=True))
    assert streamed == text


def test_vllm_fields_and_completions(client):
    choice = ask(client, 1, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    guided = ask(client, 1, extra_body={"guided_regex": "[a-c]{3}"})
    assert len(guided.choices[0].message.content) == 3
    completion = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=40,
                                           seed=3, extra_body={"response_format": {
                                               "type": "json_object"}})
    assert completion.choices[0].text.startswith("{")


def test_bad_schema_is_a_400_naming_the_field(server):
    body = {"model": MODEL_NAME, "messages": MESSAGES,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format" and "objectx" in error["message"]


def test_tool_turns_go_through_the_chat_template(server):
    """tools, an assistant turn with tool_calls and a tool result, rendered by a template that
    reads them (the test tokenizer's own ChatML template ignores tools)."""
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}"
                "({{ c.function.arguments.city }}){% endfor %}{% endfor %}")
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "messages": messages, "chat_template": template,
            "add_generation_prompt": False, "tools": TOOLS}
    rendered = httpx.post(f"{server.url}/tokenize", json=body, headers=headers, timeout=30)
    assert rendered.status_code == 200, rendered.text
    text = httpx.post(f"{server.url}/detokenize", headers=headers, timeout=30,
                      json={"model": MODEL_NAME, "tokens": rendered.json()["tokens"]})
    prompt = text.json()["prompt"]
    assert "[tool get_weather][tool get_time]<user>" in prompt
    assert "<assistant>get_weather(Oslo)<tool>sunny" in prompt
    chat = {"model": MODEL_NAME, "messages": messages, "tools": TOOLS, "max_tokens": 4,
            "chat_template": template}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=headers,
                          timeout=30)
    assert response.status_code == 200, response.text
