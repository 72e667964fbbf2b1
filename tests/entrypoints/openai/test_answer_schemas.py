"""/openapi.json is complete: request bodies, 200 schemas (JSON, server-sent events, text) and
OpenAI's error envelope for the error statuses, from the typed models of protocol.py and
answer_schemas.py. The document is checked on an in-process app (stub engine, dev routes
on); what the real server answers is then validated against it, so the models mirror the
handlers' output."""

from __future__ import annotations

import copy
import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from mrv2.entrypoints.openai.api_server import build_app
from mrv2.entrypoints.openai.cli_args import ServerConfig
from mrv2.entrypoints.openai.server_routes import DEV_MODE_ENV

from .conftest import API_KEY, MODEL_NAME

REF = "#/components/schemas/"
# POST routes that take no body (vLLM's: /sleep and /wake_up take query parameters).
BODYLESS_POSTS = {"/ping", "/reset_prefix_cache", "/sleep", "/wake_up"}
BODIES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/v1/responses": "ResponsesRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
          "/v1/embeddings": "EmbeddingRequest", "/score": "ScoreRequest",
          "/v1/score": "ScoreRequest", "/rerank": "RerankRequest", "/v1/rerank": "RerankRequest",
          "/v2/rerank": "RerankRequest"}


class StubEngine:
    errored = False

    def __init__(self, runner: str = "generate") -> None:
        self.config = SimpleNamespace(model_config=SimpleNamespace(
            max_model_len=64, vocab_size=100, runner=runner))

    def get_tokenizer(self):
        return None


def make_client(runner: str, **config) -> TestClient:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEV_MODE_ENV, "1")
        app = build_app(StubEngine(runner), ServerConfig(
            model="/no-model", served_model_names=["m"], generation_config="vllm",
            api_key=API_KEY, **config))
    return TestClient(app)


@pytest.fixture(scope="module")
def app_client():
    return make_client("generate")


def read_document(client: TestClient) -> dict:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


@pytest.fixture(scope="module")
def document(app_client):
    return read_document(app_client)


@pytest.fixture(scope="module")
def pooling_document():
    return read_document(make_client("pooling"))


def operations(document):
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield path, method, operation


COMMON = {("/v1/models", "get"), ("/tokenize", "post"), ("/detokenize", "post"),
          ("/health", "get"), ("/ping", "get"), ("/ping", "post"), ("/load", "get"),
          ("/version", "get"), ("/metrics", "get"), ("/sleep", "post")}
GENERATION = {("/v1/completions", "post"), ("/v1/chat/completions", "post"),
              ("/v1/responses", "post"), ("/v1/responses/{response_id}", "get")}
POOLING = {("/v1/embeddings", "post"), ("/score", "post"), ("/v1/score", "post"),
           ("/rerank", "post"), ("/v1/rerank", "post"), ("/v2/rerank", "post")}


def test_each_runner_documents_the_routes_it_serves(document, pooling_document):
    """The other runner's routes answer vLLM's 400 (test_serving_embedding.py) but are not
    described: a schema-driven client would call them and be refused."""
    generate = {(p, m) for p, m, _ in operations(document)}
    pooling = {(p, m) for p, m, _ in operations(pooling_document)}
    assert COMMON | GENERATION <= generate and not generate & POOLING
    assert COMMON | POOLING <= pooling and not pooling & GENERATION
    assert "EmbeddingRequest" in pooling_document["components"]["schemas"]
    assert "CompletionRequest" not in pooling_document["components"]["schemas"]


def test_token_ids_are_bounded_by_the_vocabulary(document):
    schemas = document["components"]["schemas"]
    assert "x-mrv2-token-id" not in json.dumps(document)
    tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert (tokens["minimum"], tokens["maximum"]) == (0, 99)  # the stub's vocabulary of 100
    keys = schemas["ChatCompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]
    pattern = re.compile(keys["propertyNames"]["pattern"])
    assert [k for k in range(300) if pattern.match(str(k))] == list(range(100))
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]
    assert {"type": "string", "minLength": 1} in prompt["anyOf"]


def test_every_operation_is_documented(document, pooling_document):
    for doc in (document, pooling_document):
        check_operations(doc)


def check_operations(document):
    schemas = document["components"]["schemas"]
    ids = [op["operationId"] for _, _, op in operations(document)]
    assert len(ids) == len(set(ids))
    for path, method, operation in operations(document):
        where = f"{method.upper()} {path}"
        if method == "post" and path not in BODYLESS_POSTS:
            body = operation["requestBody"]["content"]["application/json"]["schema"]
            assert body == {"$ref": REF + BODIES[path]}, where
            assert operation["requestBody"]["required"] is True
        else:
            assert "requestBody" not in operation, where
        responses = operation["responses"]
        assert "422" not in responses, where  # validation errors are 400s here
        assert responses["200"]["content"], where
        for media_type, content in responses["200"]["content"].items():
            assert content.get("schema") or media_type.startswith("text/"), where
            if media_type == "application/json":
                assert content["schema"]["$ref"].startswith(REF), where
        for status, response in responses.items():
            if status >= "400":
                assert response["content"] == {
                    "application/json": {"schema": {"$ref": REF + "ErrorResponse"}}}, where
    text = json.dumps(document)
    assert set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', text)) == set(schemas)
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_the_models_are_complete(document):
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"messages", "tools", "response_format", "tool_choice", "stream"} <= set(chat)
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "choices" in schemas["CompletionResponse"]["properties"]
    assert "delta" in schemas["ChatCompletionStreamChoice"]["properties"]
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    chat_ok = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    # Each event described, not the stream as a whole (which a `schema` beside it would be).
    assert list(chat_ok["text/event-stream"]) == ["itemSchema"]
    done, events = chat_ok["text/event-stream"]["itemSchema"]["properties"]["data"]["anyOf"]
    assert done == {"const": "[DONE]"}
    assert events["contentSchema"] == {"anyOf": [{"$ref": REF + "ChatCompletionStreamResponse"},
                                                 {"$ref": REF + "ErrorResponse"}]}
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4; charset=utf-8"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        assert "401" in document["paths"][path][next(iter(document["paths"][path]))]["responses"]


def test_documenting_changes_no_error(app_client):
    """The handlers still parse their bodies: bad ones are 400s in OpenAI's envelope."""
    for path, body, param in (("/tokenize", b'{"prompt": ', None),
                              ("/detokenize", b'{"tokens": "x"}', "tokens"),
                              ("/sleep?level=x", b"", "query.level")):
        response = app_client.post(path, content=body)
        assert response.status_code == 400, path
        assert response.json()["error"]["param"] == param
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert app_client.post("/v1/completions", json={}).status_code == 401
    assert app_client.get("/health").content == b""


# -- the real server's answers against the document ---------------------------------------

def validator(document, name: str) -> jsonschema.Draft202012Validator:
    """Validates against components/schemas/`name`; response models are closed (a field the
    handler sends that the model lacks fails), request-side ones stay as documented."""
    schemas = copy.deepcopy(document["components"]["schemas"])
    for schema in schemas.values():
        if schema.get("type") == "object" and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    return jsonschema.Draft202012Validator({"$ref": REF + name,
                                            "components": {"schemas": schemas}})


def events(response: httpx.Response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


NAMED_TOOL = {"tools": [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}],
    "tool_choice": {"type": "function", "function": {"name": "get_time"}}}


def test_the_server_answers_what_the_document_says(server, tiny_llama):
    document = httpx.get(f"{server.url}/openapi.json").json()
    headers = server.headers()

    def post(path: str, body: dict, name: str, status: int = 200, **kwargs) -> None:
        response = httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60,
                              **kwargs)
        assert response.status_code == status, response.text
        if body.get("stream") and status == 200:
            assert response.headers["content-type"].startswith("text/event-stream")
            for chunk in events(response):
                validator(document, name).validate(chunk)
        else:
            validator(document, name).validate(response.json())

    completion = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, "logprobs": 2}
    post("/v1/completions", {**completion, "echo": True}, "CompletionResponse")
    post("/v1/completions", {**completion, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}, "CompletionStreamResponse")
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    post("/v1/chat/completions", chat, "ChatCompletionResponse")
    post("/v1/chat/completions", {**chat, "stream": True, "stream_options": {
        "include_usage": True}}, "ChatCompletionStreamResponse")
    tools = {**chat, **NAMED_TOOL, "max_tokens": 30}
    post("/v1/chat/completions", tools, "ChatCompletionResponse")
    post("/v1/chat/completions", {**tools, "stream": True}, "ChatCompletionStreamResponse")
    post("/tokenize", {"prompt": "hi", "return_token_strs": True}, "TokenizeResponse")
    post("/tokenize", {"messages": chat["messages"]}, "TokenizeResponse")
    post("/detokenize", {"tokens": [1, 2]}, "DetokenizeResponse")
    for path, name in (("/v1/models", "ModelList"), ("/version", "VersionResponse"),
                       ("/load", "LoadResponse")):
        response = httpx.get(f"{server.url}{path}", headers=headers)
        validator(document, name).validate(response.json())
    # Errors: 400, 404, 401, all the envelope.
    post("/v1/completions", {**completion, "temperature": -1}, "ErrorResponse", 400)
    post("/v1/chat/completions", {**chat, "model": "nope"}, "ErrorResponse", 404)
    unauthorized = httpx.post(f"{server.url}/v1/completions", json=completion)
    assert unauthorized.status_code == 401
    validator(document, "ErrorResponse").validate(unauthorized.json())
    metrics = httpx.get(f"{server.url}/metrics")
    metrics_doc = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert metrics.headers["content-type"] in metrics_doc
    assert httpx.get(f"{server.url}/health").content == b""


def test_the_responses_route_answers_what_the_document_says(server):
    document = httpx.get(f"{server.url}/openapi.json").json()
    url, headers = f"{server.url}/v1/responses", server.headers()
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 3,
            "tools": [{"type": "function", **NAMED_TOOL["tools"][0]["function"]}]}
    for extra in ({}, {"tool_choice": {"type": "function", "name": "get_time"},
                       "max_output_tokens": 20}):
        response = httpx.post(url, json={**body, **extra}, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        validator(document, "ResponsesResponse").validate(response.json())
        stored = httpx.get(f"{url}/{response.json()['id']}", headers=headers)
        validator(document, "ResponsesResponse").validate(stored.json())
        streamed = httpx.post(url, json={**body, **extra, "stream": True}, headers=headers,
                              timeout=60)
        assert streamed.headers["content-type"].startswith("text/event-stream")
        for event in streamed.text.split("\n\n")[:-1]:
            kind, data = event.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            validator(document, "ResponseStreamEvent").validate(event)
    missing = httpx.get(f"{url}/resp_nope", headers=headers)
    assert missing.status_code == 404
    validator(document, "ErrorResponse").validate(missing.json())


def test_the_schema_refuses_what_the_server_refuses(document):
    """Cross-field rules the handlers enforce are in the schema too, so a schema-valid body is
    never a 400 (schemathesis's positive_data_acceptance)."""
    def valid(model: str, body: dict) -> bool:
        schema = {"$ref": REF + model, "components": document["components"]}
        return jsonschema.Draft202012Validator(schema).is_valid(body)

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert valid("ChatCompletionRequest", chat)
    assert not valid("ChatCompletionRequest", {**chat, "continue_final_message": True})
    assert valid("ChatCompletionRequest", {**chat, "continue_final_message": True,
                                           "add_generation_prompt": False})
    assert valid("TokenizeRequest", {"prompt": "hi"}) and valid("TokenizeRequest", chat)
    assert not valid("TokenizeRequest", {"prompt": "hi", **chat})
    assert not valid("TokenizeRequest", {"prompt": None, "messages": None})
    assert not valid("TokenizeRequest", {"prompt": "", "messages": []})
    for prompt in ("", [], [""], [[]], [100]):
        assert not valid("CompletionRequest", {"prompt": prompt}), prompt
    assert valid("CompletionRequest", {"prompt": [[1, 2], [99]]})
    assert not valid("CompletionRequest", {"prompt": "x", "logit_bias": {"100": 1.0}})
    assert valid("CompletionRequest", {"prompt": "x", "max_tokens": 63})  # the stub's 64
    assert not valid("CompletionRequest", {"prompt": "x", "max_tokens": 64})
    assert not valid("ChatCompletionRequest", {**chat, "tool_choice": "required"})
    for model, body in (("ChatCompletionRequest", chat), ("CompletionRequest", {"prompt": "x"}),
                        ("ResponsesRequest", {"input": "hi"})):
        options = {**body, "stream_options": {"include_usage": True}}
        assert not valid(model, options) and valid(model, {**options, "stream": True}), model
    for stop in ("", ["x", ""]):  # SamplingParams refuses empty stop strings
        assert not valid("ChatCompletionRequest", {**chat, "stop": stop})
    assert valid("CompletionRequest", {"prompt": "x", "stop": ["x", "y"]})
    assert not valid("ChatCompletionRequest", {**chat, "functions": [{"name": "f"}]})
    assert not valid("ChatCompletionRequest", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert not valid("ResponsesRequest", {"input": "hi", "truncation": "auto"})
    assert not valid("ResponsesRequest", {"input": [{"type": ""}]})  # a kind not served
    assert not valid("ResponsesRequest", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]})
    assert valid("ResponsesRequest", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}]}]})
    # No conversation: reasoning items alone (dropped), or nothing, with no instructions.
    for empty in ({"input": []}, {"input": [{"type": "reasoning"}]},
                  {"input": [], "instructions": ""}):
        assert not valid("ResponsesRequest", empty), empty
    assert valid("ResponsesRequest", {"input": [], "instructions": "be brief"})
    assert valid("ResponsesRequest", {"input": [{"type": "reasoning"}],
                                      "previous_response_id": "resp_1"})
    assert valid("ResponsesRequest", {"input": [{"type": "reasoning", "id": "r", "summary": []},
                                                {"role": "user", "content": "hi"}]})
    assert not valid("ResponsesRequest", {"input": "hi", "prompt": {"id": "p"}})
    assert not valid("ResponsesRequest", {"input": "hi", "tool_choice": {"type": "function",
                                                                         "name": "f"}})
    # The stub server has no --tool-call-parser: tools need an explicit tool_choice.
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert not valid("ChatCompletionRequest", {**chat, "tools": tools})
    assert valid("ChatCompletionRequest", {**chat, "tools": tools, "tool_choice": "none"})
    with_parser = read_document(make_client("generate", tool_call_parser="hermes"))
    assert jsonschema.Draft202012Validator(
        {"$ref": REF + "ChatCompletionRequest", "components": with_parser["components"]}
    ).is_valid({**chat, "tools": tools})
    # Refused values (schemathesis's negative and stateful runs sent them): a built-in tool, a
    # json_schema text format without its schema, a whitespace pattern.
    assert not valid("ResponsesRequest", {"input": "hi", "tool_choice": "none",
                                          "tools": [{"type": "web_search"}]})
    assert valid("ResponsesRequest", {"input": "hi", "tool_choice": "none",
                                      "tools": [{"type": "function", "name": "f"}]})
    assert not valid("ResponsesRequest", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x"}}})
    assert valid("ResponsesRequest", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
    assert not valid("ChatCompletionRequest", {**chat, "structured_outputs": {
        "json": {"type": "object"}, "whitespace_pattern": " "}})
    assert not valid("ChatCompletionRequest", {**chat, "guided_whitespace_pattern": " "})
    # A chat response_format without what its type needs (a longer stateful run sent a
    # structural_tag with structures but no triggers).
    for refused in ({"type": "structural_tag", "structures": [{"begin": "<a>"}]},
                    {"type": "structural_tag", "format": None},
                    {"type": "structural_tag", "structures": [], "triggers": ["<a"]},
                    {"type": "json_schema", "json_schema": {"name": "x"}}):
        assert not valid("ChatCompletionRequest", {**chat, "response_format": refused}), refused
    for taken in ({"type": "structural_tag", "structures": [{"begin": "<a>"}],
                   "triggers": ["<a"]},
                  {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}},
                  {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
                  {"type": "json_object"}, {"type": "text"}):
        assert valid("ChatCompletionRequest", {**chat, "response_format": taken}), taken
    # An empty choice list is refused (SamplingParams needs one string at least).
    assert not valid("ChatCompletionRequest", {**chat, "guided_choice": []})
    assert not valid("ChatCompletionRequest", {**chat, "structured_outputs": {"choice": []}})
    assert valid("ChatCompletionRequest", {**chat, "guided_choice": ["a"]})


@pytest.mark.parametrize("model, body", [
    ("CompletionRequest", {"prompt": "x"}),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi"}]}),
    ("ResponsesRequest", {"input": "hi"}), ("TokenizeRequest", {"prompt": "hi"})])
def test_null_is_valid_for_every_optional_field(document, model, body):
    """The server reads null as a field's default (vLLM's rule), so the document admits it
    for each optional field; schemathesis's negative mode reported those 200s as schema
    violations accepted while the document said otherwise."""
    schema = {"$ref": REF + model, "components": document["components"]}
    validator = jsonschema.Draft202012Validator(schema)
    target = document["components"]["schemas"][model]
    optional = [name for name in target["properties"] if name not in target.get("required", ())]
    assert len(optional) > 5
    for name in optional:
        if name not in body:
            assert validator.is_valid({**body, name: None}), name


@pytest.mark.parametrize("model", ["CompletionRequest", "ChatCompletionRequest",
                                   "ResponsesRequest"])
def test_sampling_ranges_in_the_schema_are_what_sampling_params_accepts(document, model):
    """Each real-valued sampling field's schema accepts exactly the values SamplingParams
    does, probed at and beside both ends of its range."""
    from mrv2.sampling_params import SAMPLING_RANGES, SamplingParams

    properties = document["components"]["schemas"][model]["properties"]
    fields = [name for name in SAMPLING_RANGES if name in properties]
    assert {"temperature", "top_p"} <= set(fields)
    for name in fields:
        check = jsonschema.Draft202012Validator(properties[name])
        for value in (-2.5, -2, -1e-9, 0, 1e-9, 0.5, 1, 1 + 1e-9, 2, 2.5, 1e6, None):
            try:
                SamplingParams(**({} if value is None else {name: value}))
                accepted = True
            except ValueError:
                accepted = False
            assert check.is_valid(value) == accepted, (name, value)
