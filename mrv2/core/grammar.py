"""Grammars of structured outputs, on xgrammar (vLLM's default backend).

A request's `StructuredOutputsParams` becomes an xgrammar grammar in two steps:
`validate_structured_outputs` (front end, before the request is queued: builds the grammar
without a vocabulary, so a bad schema, regex or grammar is a ValueError naming the field) and
`GrammarCompiler.compile` (engine core, off the step path: the grammar against the model's
vocabulary, which precomputes the token masks). `grammar_key` is the compile-cache key: equal
keys give the same compiled grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from mrv2.config import StructuredOutputsConfig
from mrv2.sampling_params import StructuredOutputsParams

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and some with a
# "Check failed: ... is false: "): the user needs only what follows.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A structured-output constraint that xgrammar cannot build; names the field."""


def grammar_key(params: StructuredOutputsParams, config: StructuredOutputsConfig
                ) -> tuple[str, str, bool]:
    """(kind, source text, whether JSON whitespace is free): what the compiled grammar depends
    on. The JSON schema comes out with its additionalProperties filled in when asked."""
    kind = params.kind
    any_whitespace = not (params.disable_any_whitespace or config.disable_any_whitespace)
    if kind == "json":
        schema = params.json if isinstance(params.json, dict) else _parse_json(params.json)
        if params.disable_additional_properties or config.disable_additional_properties:
            schema = _without_additional_properties(schema)
        return kind, json.dumps(schema), any_whitespace  # property order is the output order
    if kind == "json_object":
        # OpenAI's json_object mode promises an object; xgrammar's builtin JSON grammar takes
        # any value, with free whitespace. An object schema keeps to both promises.
        return "json", '{"type": "object"}', any_whitespace
    if kind == "choice":
        # One alternative per choice; json.dumps escapes quotes and backslashes as EBNF wants.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return "grammar", f"root ::= {alternatives}", any_whitespace
    return kind, getattr(params, kind), any_whitespace


def validate_structured_outputs(params: StructuredOutputsParams,
                                config: StructuredOutputsConfig) -> None:
    """GrammarError naming the field unless xgrammar can build the constraint's grammar."""
    kind, source, any_whitespace = grammar_key(params, config)
    field = params.kind
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(source, any_whitespace=any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind == "grammar":
            _grammar_from_text(source)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(source)
    except (RuntimeError, ValueError, TypeError) as error:
        raise GrammarError(f"structured_outputs.{field} is invalid: {_message(error)}") from None


class GrammarCompiler:
    """Compiles grammars against one model's vocabulary. Thread-safe (xgrammar's compiler is);
    xgrammar keeps its own cache of compiled grammars, keyed like `grammar_key`, evicting the
    least recently used beyond `cache_limit_bytes` (-1: unbounded)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 config: StructuredOutputsConfig, cache_limit_bytes: int = -1) -> None:
        # vocab_size is the model's (its logits' width), which may exceed the tokenizer's:
        # ids past the tokenizer's vocabulary are never allowed.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=cache_limit_bytes)
        self.config = config
        self.vocab_size = vocab_size

    @property
    def cache_size_bytes(self) -> int:
        return self._compiler.get_cache_size_bytes()

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, source, any_whitespace = grammar_key(params, self.config)
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(source, any_whitespace=any_whitespace)
            if kind == "regex":
                return self._compiler.compile_regex(source)
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(source)
            return self._compiler.compile_grammar(_grammar_from_text(source))
        except (RuntimeError, ValueError, TypeError) as error:
            raise GrammarError(f"structured_outputs.{params.kind}: {_message(error)}") from None


def _grammar_from_text(text: str) -> xgr.Grammar:
    """GBNF / EBNF (rules written `name ::= ...`, the root rule `root`) or Lark (`name: ...`,
    the root rule `start`), told apart by the `::=` that only the first uses."""
    if "::=" in text:
        return xgr.Grammar.from_ebnf(text)
    return xgr.Grammar.from_lark(text)


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise GrammarError(f"structured_outputs.json is not valid JSON: {error}") from None


def _without_additional_properties(schema: Any) -> Any:
    """A copy in which every object schema that does not say takes no other properties."""
    if isinstance(schema, list):
        return [_without_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _without_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _message(error: Exception) -> str:
    text = str(error).strip()
    return _CPP_PREFIX.sub("", text.splitlines()[0]) if text else type(error).__name__
