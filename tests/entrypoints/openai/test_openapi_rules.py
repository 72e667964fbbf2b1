"""openapi_rules: the decimal pattern below a bound, the marks filled per server, and token
ids that take integral floats (the cross-field rules are checked on the published document in
test_openapi.py)."""

from __future__ import annotations

import re

import pytest
from pydantic import TypeAdapter, ValidationError

from mrv2.entrypoints.openai.openapi_rules import (CONTEXT_MARK, TOKEN_ID_MARK, TokenId,
                                                   decimal_below_pattern, fill_model_bounds)


@pytest.mark.parametrize("limit", [1, 2, 7, 10, 11, 100, 101, 2048, 2112, 49152, 100000])
def test_pattern_matches_exactly_the_numbers_below(limit):
    pattern = re.compile(decimal_below_pattern(limit))
    assert [k for k in range(3 * limit + 20) if pattern.match(str(k))] == list(range(limit))
    for text in ("01", "-1", "", "1x", " 1"):
        assert not pattern.match(text)


def test_marks_become_the_models_bounds_or_go():
    schema = {"a": {"type": "integer", TOKEN_ID_MARK: "integer"},
              "b": [{"propertyNames": {TOKEN_ID_MARK: "string"}}],
              "c": {"type": "integer", CONTEXT_MARK: True}}
    fill_model_bounds(schema, vocab_size=100, max_model_len=64)
    assert schema["a"] == {"type": "integer", "maximum": 99}
    assert schema["b"][0]["propertyNames"]["pattern"] == decimal_below_pattern(100)
    assert schema["c"] == {"type": "integer", "maximum": 63}
    bare = {"a": {TOKEN_ID_MARK: "integer"}, "c": {CONTEXT_MARK: True}}
    fill_model_bounds(bare, None, None)
    assert bare == {"a": {}, "c": {}}


def test_token_ids_take_integral_floats_only():
    ids = TypeAdapter(list[TokenId])
    assert ids.validate_python([5.0, 3]) == [5, 3]
    for bad in (5.5, "5", True, -1.0, 2**63):
        with pytest.raises(ValidationError):
            ids.validate_python([bad])
