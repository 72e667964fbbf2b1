"""The base of every request body model: vLLM's rules for fields beyond the declared ones and
for null, and a published schema that says what those rules accept.

- An unknown field is logged as ignored, not refused, so a client written against a newer API
  keeps working (an unsupported *value* of a known field is still a 400 naming it).
- null for a field with a default means the default: OpenAI's schema lets a client send null
  for any optional field (the SDKs do), and vLLM accepts it. So the schema shows every such
  field as nullable (schemathesis's negative mode sent null for them, saw a 200 and reported a
  schema-violating request accepted); a required field stays non-null.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger(__name__)

# Bounds as pydantic leaves them on a validator-wrapped type (openapi_rules.JsonInt | None
# with Field(ge=...)): enforced, but rendered under pydantic's names, which JSON Schema ignores.
_BOUND_NAMES = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum",
                "lt": "exclusiveMaximum"}
# Keys that describe a property rather than constrain it: they stay outside the anyOf.
_ANNOTATIONS = ("title", "description", "default", "examples", "deprecated")


def admits_null(schema: dict[str, Any]) -> bool:
    """Whether a JSON schema already lets null through (or constrains nothing)."""
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    if any(admits_null(branch) for key in ("anyOf", "oneOf")
           for branch in schema.get(key, ())):
        return True
    return not any(key not in _ANNOTATIONS for key in schema)


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` widened to admit null, its annotations kept at the top."""
    if admits_null(schema):
        return schema
    outer = {key: schema[key] for key in _ANNOTATIONS if key in schema}
    inner = {key: value for key, value in schema.items() if key not in _ANNOTATIONS}
    return {"anyOf": [inner, {"type": "null"}], **outer}


def standard_bounds(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with pydantic's bound names (ge, le, gt, lt) renamed to JSON Schema's, in it
    and in its anyOf / oneOf branches."""
    renamed = {_BOUND_NAMES.get(key, key): value for key, value in schema.items()}
    for key in ("anyOf", "oneOf"):
        if key in renamed:
            renamed[key] = [standard_bounds(branch) for branch in renamed[key]]
    return renamed


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> "OpenAIBaseModel":
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(self.model_extra))
            self.model_extra.clear()
        return self

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler) -> dict[str, Any]:
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        required = set(target.get("required", ()))
        properties = target.get("properties", {})
        for name, prop in properties.items():
            prop = standard_bounds(prop)
            properties[name] = prop if name in required else nullable(prop)
        return schema
