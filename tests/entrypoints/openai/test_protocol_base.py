"""The request models' shared rules: null means the default and the schema says so; booleans
are JSON booleans."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mrv2.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from mrv2.entrypoints.openai.protocol_base import admits_null, nullable, standard_bounds
from mrv2.entrypoints.openai.protocol_pooling import EmbeddingRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_admits_null_and_nullable():
    assert admits_null({"type": "null"}) and admits_null({"type": ["integer", "null"]})
    assert admits_null({"anyOf": [{"type": "string"}, {"type": "null"}]})
    assert admits_null({"title": "Anything"})  # no constraint at all
    assert not admits_null({"type": "boolean", "default": True})
    widened = nullable({"type": "boolean", "default": True, "title": "Echo"})
    assert widened == {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": True,
                       "title": "Echo"}
    assert nullable({"type": "null"}) == {"type": "null"}


@pytest.mark.parametrize("model, required", [
    (CompletionRequest, {"prompt"}), (ChatCompletionRequest, {"messages"}),
    (EmbeddingRequest, {"input"})])
def test_published_schema_admits_null_exactly_where_the_model_does(model, required):
    """Every optional property admits null in the schema (null is its default), and the model
    takes null for each; a required one does not admit it."""
    schema = model.model_json_schema()
    properties = schema["properties"]
    assert set(schema.get("required", ())) == required
    for name, prop in properties.items():
        assert admits_null(prop) == (name not in required), name
    base = {"prompt": "x"} if model is CompletionRequest else (
        CHAT if model is ChatCompletionRequest else {"input": "x"})
    assert model.model_validate({**base, **{name: None for name in properties
                                            if name not in required}})


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, 1.0])
@pytest.mark.parametrize("field", ["echo", "add_special_tokens", "skip_special_tokens", "stream"])
def test_booleans_are_json_booleans(field, value):
    """A string or number where the schema says boolean is refused (pydantic's lax mode would
    take "yes" or 1), as OpenAI's API refuses it."""
    with pytest.raises(ValidationError, match=field):
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert CompletionRequest.model_validate({"prompt": "x", field: False})


def test_bounds_use_json_schema_names():
    """pydantic renders the bounds of a validator-wrapped integer (JsonInt | None with
    Field(ge=...)) as ge / le, which JSON Schema ignores: the published schema renames them."""
    assert standard_bounds({"anyOf": [{"type": "integer", "ge": 0, "le": 5}, {"type": "null"}],
                            "default": None}) == {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}],
        "default": None}
    logprobs = CompletionRequest.model_json_schema()["properties"]["logprobs"]["anyOf"][0]
    assert (logprobs["minimum"], logprobs["maximum"]) == (0, 20) and "ge" not in logprobs


@pytest.mark.parametrize("field, value", [("max_tokens", "5"), ("max_tokens", True),
                                          ("n", "2"), ("temperature", "0.5"),
                                          ("temperature", False), ("logit_bias", {"1": "2"}),
                                          ("logit_bias", {"1": True})])
def test_numbers_are_json_numbers(field, value):
    """A string or boolean where the schema says integer or number is refused; an integral
    float for an integer and an integer for a number are what JSON Schema calls them."""
    with pytest.raises(ValidationError, match=field):
        CompletionRequest.model_validate({"prompt": "x", field: value})
    request = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 5.0,
                                                "temperature": 1, "logit_bias": {"1": 2}})
    assert request.max_tokens == 5 and request.temperature == 1.0
