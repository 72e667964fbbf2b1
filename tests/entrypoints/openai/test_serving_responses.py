"""`POST /v1/responses` and `GET /v1/responses/{id}` through the official openai client against
the shared real server (random weights: greedy outputs are compared with the chat route's, and
the grammar guarantees the shapes)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import jsonschema
import openai
import pytest
from openai.types.responses import Response

from mrv2.entrypoints.openai.chat_output import ChatChoiceParser
from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.reasoning_parsers import ReasoningParser
from mrv2.entrypoints.openai.responses_protocol import ResponsesRequest
from mrv2.entrypoints.openai.serving_responses import OpenAIServingResponses, chat_messages
from mrv2.outputs import CompletionOutput, RequestOutput
from mrv2.sampling_params import SamplingParams

from .conftest import MODEL_NAME

CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hi."}]
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Oslo", "Bergen", "Tromsø"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}]
PARAMS = {t["name"]: t["parameters"] for t in TOOLS}


def respond(client, **kwargs):
    kwargs.setdefault("input", "Say hi.")
    kwargs.setdefault("instructions", "Be brief.")
    kwargs.setdefault("max_output_tokens", 8)
    return client.responses.create(model=MODEL_NAME, temperature=0.0, **kwargs)


@pytest.fixture(scope="module")
def greedy(client):
    """The reference: the instructions and input above, greedy, 8 tokens at most (the
    answer validated against the client's type, whose parsing is lenient)."""
    raw = client.responses.with_raw_response.create(
        model=MODEL_NAME, temperature=0.0, input="Say hi.", instructions="Be brief.",
        max_output_tokens=8)
    Response.model_validate(raw.http_response.json())
    return raw.parse()


def test_text_matches_the_chat_route(client, greedy):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION,
                                          max_tokens=8, temperature=0.0)
    choice = chat.choices[0]
    assert greedy.id.startswith("resp_") and greedy.object == "response"
    assert greedy.model == MODEL_NAME and greedy.output_text == choice.message.content
    [message] = greedy.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.id.startswith("msg_")
    usage = greedy.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0
    # What the request set is echoed.
    assert greedy.instructions == "Be brief." and greedy.max_output_tokens == 8
    assert greedy.temperature == 0.0 and greedy.tools == [] and greedy.store is True
    length = choice.finish_reason == "length"
    assert greedy.status == ("incomplete" if length else "completed")
    assert (greedy.incomplete_details is not None) == length


def test_message_list_input_is_the_same_conversation(client, greedy):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Say hi."}]}]
    out = respond(client, input=items, instructions=None)
    assert out.output_text == greedy.output_text
    assert out.usage.input_tokens == greedy.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    out = respond(client, max_output_tokens=2)
    assert out.status == "incomplete" and out.usage.output_tokens == 2
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete"


def test_streaming_equals_non_streaming(client, greedy):
    events = list(respond(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == greedy.output_text
    final = events[-1].response
    assert final.output_text == greedy.output_text and final.status == greedy.status
    assert final.usage.output_tokens == greedy.usage.output_tokens
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    with client.responses.stream(model=MODEL_NAME, input="Say hi.", instructions="Be brief.",
                                 max_output_tokens=8, temperature=0.0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        helper = stream.get_final_response()
    assert "".join(texts) == helper.output_text == greedy.output_text


def test_json_schema_output_validates(client):
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER,
                      "strict": True}}
    out = respond(client, text=fmt, max_output_tokens=40)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), WEATHER)
    assert out.text.format.type == "json_schema"
    streamed = "".join(e.delta for e in respond(client, text=fmt, max_output_tokens=40,
                                                stream=True)
                       if e.type == "response.output_text.delta")
    assert streamed == out.output_text
    anything = respond(client, text={"format": {"type": "json_object"}}, max_output_tokens=4)
    assert anything.output_text.startswith("{")


def calls_of(response) -> list[tuple[str, str]]:
    assert all(item.type == "function_call" for item in response.output)
    return [(item.name, item.arguments) for item in response.output]


def test_tool_calls_parse_and_stream_the_same(client):
    required = respond(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                       max_output_tokens=60)
    [(name, arguments)] = calls_of(required)
    assert required.status == "completed"
    jsonschema.validate(json.loads(arguments), PARAMS[name])
    named = {"type": "function", "name": "get_weather"}
    out = respond(client, tools=TOOLS, tool_choice=named, max_output_tokens=60)
    [(name, arguments)] = calls_of(out)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert name == "get_weather" and out.tool_choice.name == "get_weather"
    [call] = out.output
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    with client.responses.stream(model=MODEL_NAME, input="Say hi.", instructions="Be brief.",
                                 max_output_tokens=60, temperature=0.0, tools=TOOLS,
                                 tool_choice=named) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == arguments
    assert calls_of(final) == [(name, arguments)]
    assert final.output[0].parsed_arguments == json.loads(arguments)  # a strict tool's
    # The next turn: the call and its result as input.
    answer = respond(client, tools=TOOLS, max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": name,
         "arguments": arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answer.status in ("completed", "incomplete") and answer.output


def test_stored_responses_and_previous_response_id(client, greedy):
    assert client.responses.retrieve(greedy.id).model_dump() == greedy.model_dump()
    again = respond(client, input="And bye?", previous_response_id=greedy.id,
                    instructions=None)
    assert again.previous_response_id == greedy.id
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, temperature=0.0, messages=[
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": greedy.output_text},
            {"role": "user", "content": "And bye?"}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens  # instructions not inherited
    assert again.output_text == chat.choices[0].message.content
    unstored = respond(client, store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}},
     "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
])
def test_bad_requests_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        respond(client, **kwargs)
    assert caught.value.body["param"] == param, caught.value.body


def test_unknown_ids_are_404s(client):
    with pytest.raises(openai.NotFoundError) as caught:
        respond(client, previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")


# -- without a server: input items as chat messages, a reasoning parser, a failure mid-stream --

def parse_request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def test_items_become_chat_messages():
    request = parse_request(input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        # An earlier response's output sent back: reasoning dropped, the call joins the text.
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}",
         "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"}])
    calls = [{"id": c, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
             for c in ("c1", "c2")]
    assert chat_messages(request.input_items()) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    plain = parse_request(input="hi").input_items()
    assert chat_messages(plain) == [{"role": "user", "content": "hi"}]
    lone_call = parse_request(input=[{"type": "function_call", "call_id": "c", "name": "f",
                                      "arguments": "{}"}])
    assert chat_messages(lone_call.input_items())[0]["content"] is None


@pytest.mark.parametrize("item", [
    {"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]},
    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]},
    {"type": "web_search_call", "id": "ws_1"},
])
def test_non_text_input_is_refused(item):
    with pytest.raises(BadRequest) as caught:
        chat_messages(parse_request(input=[item]).input_items())
    assert caught.value.param == "input" and "input[0]" in caught.value.message


class StubChat:
    """The chat route's side of a response: a fixed prompt, the `outputs` as engine deltas."""

    config = SimpleNamespace(model_name="m")

    def __init__(self, outputs: list[tuple[str, list[int], str | None]], fail: bool = False):
        self.outputs, self.fail, self.prompts = outputs, fail, []

    @staticmethod
    def tokenizer(text: str, add_special_tokens: bool = False):
        return SimpleNamespace(input_ids=text.split())

    def prepare(self, chat_request):
        self.prompts.append([m.to_template_dict() for m in chat_request.messages])
        return {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=9)

    def choice_parser(self, chat_request):
        return ChatChoiceParser(chat_request, ReasoningParser())

    async def generate(self, prompt, params, request_id):
        for text, token_ids, finish in self.outputs:
            yield RequestOutput(request_id, None, [1, 2, 3], [CompletionOutput(
                0, text, token_ids, finish_reason=finish)], finish is not None)
        if self.fail:
            raise ValueError("SamplingParams.temperature=nan is not allowed")


class Connected:
    async def receive(self):
        await asyncio.Event().wait()


THINKING = [("<think>plan ", [10, 11], None), ("ahead</think>Hello", [12, 13, 14], None),
            (" there.", [15], "stop")]


def create(serving, **fields):
    return asyncio.run(serving.create(parse_request(**fields), Connected()))


def stream_events(serving, **fields) -> list[dict]:
    async def collect():
        request = parse_request(stream=True, **fields)
        return [chunk async for chunk in await serving.create(request, Connected())]

    events = []
    for chunk in asyncio.run(collect()):
        kind, data = chunk.split("\n")[:2]
        events.append(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {events[-1]['type']}"
    return events


def test_reasoning_items_usage_and_the_store_without_a_server():
    serving = OpenAIServingResponses(StubChat(THINKING))
    whole = create(serving)
    reasoning, message = whole["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "plan ahead"}]
    assert message["content"][0]["text"] == "Hello there."
    assert whole["usage"]["output_tokens"] == 6 and whole["status"] == "completed"
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 2  # "plan ahead"
    Response.model_validate(whole)  # the client's type, validated
    events = stream_events(serving)
    assert [e["type"] for e in events if e["type"].startswith("response.reasoning")] == [
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done"]
    final = events[-1]["response"]
    assert [{k: v for k, v in i.items() if k != "id"} for i in final["output"]] == \
        [{k: v for k, v in i.items() if k != "id"} for i in whole["output"]]
    assert final["usage"] == whole["usage"]
    # Stored: retrievable, and the next turn continues from its output (reasoning dropped).
    assert serving.retrieve(whole["id"]) == whole
    create(serving, input="And?", previous_response_id=whole["id"], instructions="Brief.")
    assert serving.chat.prompts[-1] == [
        {"role": "system", "content": "Brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "And?"}]


def test_an_engine_failure_mid_stream_is_the_last_event():
    serving = OpenAIServingResponses(StubChat(THINKING[:1], fail=True))
    events = stream_events(serving, store=False)
    assert events[-1]["type"] == "error" and events[-1]["param"] == "temperature"
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "response.completed" not in [e["type"] for e in events] and len(serving.store) == 0
