"""vLLM's `EngineArgs.add_cli_args(parser)`: one flag per EngineArgs field, named as vLLM names
it (`max_model_len` -> `--max-model-len`), whose parsed value is the field's value, so that
`LLM(**vars(parser.parse_args()))` and `EngineArgs.from_cli_args(args)` work as in vLLM's
example scripts. Generated from the dataclass, so a new field gets its flag without an edit."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

# The type of each flag's value, by the field's annotation with None taken out.
SCALAR_TYPES = (int, float, str)


def _value_types(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(t for t in typing.get_args(annotation) if t is not type(None))
    return (annotation,)


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object flag (`--compilation-config '{"cudagraph_mode": "NONE"}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _builtin_model() -> str | None:
    """vLLM's --model has a default; mrv2's is the built-in model, when it is installed."""
    from mrv2.models.builtin import builtin_model_path
    from mrv2.models.loader import ModelNotFoundError

    try:
        return str(builtin_model_path())
    except ModelNotFoundError:
        return None


def add_engine_args_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                          engine_args_cls: type) -> None:
    hints = typing.get_type_hints(engine_args_cls)
    for field in dataclasses.fields(engine_args_cls):
        flag = "--" + field.name.replace("_", "-")
        kinds = _value_types(hints[field.name])
        if field.name == "model":
            parser.add_argument(flag, type=str, default=_builtin_model(),
                                help="model directory, GGUF file or Hub id (default: the "
                                     "built-in SmolLM2-135M-Instruct GGUF)")
        elif kinds == (bool,):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=field.default)
        elif len(kinds) == 1 and kinds[0] in SCALAR_TYPES:
            parser.add_argument(flag, type=kinds[0], default=field.default)
        elif dict in kinds:  # a dict of a config's fields, or the config itself
            parser.add_argument(flag, type=_json_object, default=field.default,
                                help="a JSON object of the config's fields")
        else:
            raise TypeError(f"EngineArgs.{field.name}: no flag for its type {kinds}")
