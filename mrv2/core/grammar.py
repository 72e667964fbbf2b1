"""Grammars of structured outputs, on xgrammar (vLLM's default backend).

A request's `StructuredOutputsParams` becomes an xgrammar grammar in two steps:
`validate_structured_outputs` (front end, before the request is queued: builds the grammar
without a vocabulary, so a bad schema, regex or grammar is a ValueError naming the field) and
`GrammarCompiler.compile` (engine core, off the step path: the grammar against the model's
vocabulary, which precomputes the token masks). `grammar_key` is the compile-cache key: equal
keys give the same compiled grammar.

Every JSON grammar (schemas, json_object, tool calls, JSON in structural tags) goes through
`strict_json_ebnf`, so that what it allows parses with a strict JSON parser (RFC 8259: no raw
U+0000-U+001F, '"' or '\\' inside a string; Python's json.loads refuses them). xgrammar 0.2's
own rules let raw control characters into two kinds of string, which that function rewrites:
a string with minLength / maxLength, and one with a `pattern` its JSON-string regex node cannot
take (there raw quotes and backslashes too). Numbers (no leading zeros, NaN or Infinity),
unbounded strings, keys, enums and the `format`s are strict already.
"""

from __future__ import annotations

import functools
import hashlib
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
        if kind in JSON_KINDS:
            strict_json_ebnf(kind, source, any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind == "grammar":
            _grammar_from_text(source)
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
            strict = strict_json_ebnf(kind, source, any_whitespace) if kind in JSON_KINDS else None
            if strict is not None:
                return self._compiler.compile_grammar(strict)
            if kind == "json":
                return self._compiler.compile_json_schema(source, any_whitespace=any_whitespace)
            if kind == "regex":
                return self._compiler.compile_regex(source)
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(source)
            return self._compiler.compile_grammar(_grammar_from_text(source))
        except (RuntimeError, ValueError, TypeError) as error:
            raise GrammarError(f"structured_outputs.{params.kind}: {_message(error)}") from None


# The grammar kinds whose output is JSON, or holds JSON (a structural tag's json_schema parts).
JSON_KINDS = ("json", "structural_tag")
# xgrammar's character of a string with minLength / maxLength: it keeps out '"', '\', CR and LF
# only, so the other control characters stood raw. The replacement is one character of a JSON
# string: raw (not a surrogate, which xgrammar takes as UTF-8 bytes that decode to three
# U+FFFD), or an escape that stands for one character (\uXXXX but a surrogate's, so that a
# pair cannot count twice): the length bounds hold of the decoded string.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = "mrv2_json_char"
_JSON_CHAR_RULE = (_JSON_CHAR + r' ::= [^\0-\x1f\"\\\ud800-\udfff] | "\\" [\"\\/bfnrt]'
                   r' | "\\u" ([0-9A-Ca-c] [0-9A-Fa-f] | [Dd] [0-7]) [0-9A-Fa-f] [0-9A-Fa-f]')


@functools.lru_cache(maxsize=256)
def strict_json_ebnf(kind: str, source: str, any_whitespace: bool) -> str | None:
    """The EBNF of a JSON schema's (kind "json") or a structural tag's grammar, rewritten where
    xgrammar's own allows output that is not strict JSON; None where it needs no rewriting (then
    xgrammar's own compile applies). RuntimeError / ValueError on a bad schema or tag.

    A `pattern` (or patternProperties key) that xgrammar cannot make a JSON-string regex of
    (characters outside printable ASCII, or one matching only characters a JSON string escapes)
    it writes as rules over raw characters, '"', '\\' and control characters included. Such a
    pattern is swapped for a marker pattern, and then the marker's regex node in the printed
    grammar for the pattern's own rules with every character written as JSON writes it."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    markers: dict[str, str] = {}  # pattern -> the marker pattern standing for it

    def swap(pattern: str) -> str:
        if pattern not in markers and _is_raw_pattern(pattern):
            markers[pattern] = f"mrv2pattern{len(markers)}x{digest}"
        return markers.get(pattern, pattern)

    if kind == "json":
        schema = _with_patterns(json.loads(source), swap)
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace)
    else:
        grammar = xgr.Grammar.from_structural_tag(_tag_with_patterns(source, swap))
    text = str(grammar)
    strict = text.replace(_BOUNDED_STRING_CHAR, _JSON_CHAR)
    if strict != text:
        strict += "\n" + _JSON_CHAR_RULE
    for i, (pattern, marker) in enumerate(markers.items()):
        node = f'Regex("{marker}", json_string=true)'
        if node in strict:
            strict = strict.replace(node, f"mrv2_pattern_{i}_root")
            strict += "\n" + _json_encoded_rules(pattern, f"mrv2_pattern_{i}_")
    if strict == text:
        return None
    xgr.Grammar.from_ebnf(strict)  # a failure shows in validation, not on the compile thread
    return strict


def _is_raw_pattern(pattern: str) -> bool:
    """Whether xgrammar writes a string with this pattern as rules over raw characters rather
    than as its JSON-string regex node (which keeps out what a JSON string escapes)."""
    try:
        schema = json.dumps({"type": "string", "pattern": pattern})
        return "Regex(" not in str(xgr.Grammar.from_json_schema(schema))
    except (RuntimeError, ValueError, TypeError):
        return False  # a bad pattern: the schema's own build says so


# Keywords whose value maps names (not keywords) to schemas; patternProperties' names are
# patterns. Keywords whose value is data, never a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA_KEYWORDS = ("enum", "const", "default", "examples", "required")


def _with_patterns(schema: Any, swap: Any) -> Any:
    """A copy of a JSON schema with every `pattern` and patternProperties name p as swap(p)."""
    if isinstance(schema, list):
        return [_with_patterns(s, swap) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            value = swap(value)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rename = swap if key == "patternProperties" else str
            value = {rename(k): _with_patterns(v, swap) for k, v in value.items()}
        elif key not in _DATA_KEYWORDS:
            value = _with_patterns(value, swap)
        out[key] = value
    return out


def _tag_with_patterns(source: str, swap: Any) -> str:
    """A structural tag's text with its json_schema parts' patterns swapped."""
    try:
        tag = json.loads(source)
    except ValueError:
        return source  # xgrammar says what is wrong with it

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        return {k: _with_patterns(v, swap) if k == "json_schema" and node.get("type") ==
                "json_schema" else walk(v) for k, v in node.items()}

    return json.dumps(walk(tag))


# The printed EBNF of a regex: literals, character classes, rule names, and the rest.
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_]\w*|.', re.S)
# xgrammar's printed escapes (its EscapeString) besides \xHH, \uHHHH and \UHHHHHHHH.
_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27, "0": 0}
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
# What a JSON string holds only escaped; and what it cannot hold raw (surrogates have no UTF-8).
_MUST_ESCAPE = [*range(0x20), ord('"'), ord("\\")]
_NOT_RAW = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF)]


def _json_encoded_rules(pattern: str, prefix: str) -> str:
    """The rules of a regex's grammar (its root `prefix`root) over the text of the JSON strings
    that decode to a match: every character the regex matches as JSON may write it."""
    out = []
    for token in _EBNF_TOKEN.findall(str(xgr.Grammar.from_regex(pattern))):
        if token.startswith('"'):
            out.append(_json_literal([cp for cp, _ in _codepoints(token[1:-1])]))
        elif token.startswith("["):
            out.append(_json_class(token[1:-1]))
        elif token[0].isalpha() or token[0] == "_":
            out.append(prefix + token)
        else:
            out.append(token)
    return "".join(out)


def _codepoints(body: str) -> list[tuple[int, bool]]:
    """(code point, whether escaped) of each character of a printed literal or class."""
    out, i = [], 0
    while i < len(body):
        if body[i] != "\\":
            out.append((ord(body[i]), False))
            i += 1
            continue
        letter, width = body[i + 1], _HEX_WIDTH.get(body[i + 1], 0)
        out.append((int(body[i + 2:i + 2 + width], 16) if width
                    else _C_ESCAPES.get(letter, ord(letter)), True))
        i += 2 + width
    return out


def _json_literal(code_points: list[int]) -> str:
    parts, run = [], ""
    for cp in code_points:
        if _is_raw(cp):
            run += chr(cp)
            continue
        parts += [_ebnf_literal(run)] if run else []
        parts.append(_json_char(cp))
        run = ""
    parts += [_ebnf_literal(run)] if run else []
    return "(" + " ".join(parts) + ")" if parts else '""'


def _json_class(body: str) -> str:
    negated = body.startswith("^")
    chars = _codepoints(body[negated:])
    ranges, i = [], 0
    while i < len(chars):
        is_range = i + 2 < len(chars) and chars[i + 1] == (ord("-"), False)
        ranges.append((chars[i][0], chars[i + 2 if is_range else i][0]))
        i += 3 if is_range else 1
    allowed = _minus([(0, 0x10FFFF)], ranges) if negated else ranges
    raw = _minus(allowed, _NOT_RAW)
    parts = ["[" + "".join(_ebnf_char(lo) + (f"-{_ebnf_char(hi)}" if hi > lo else "")
                           for lo, hi in raw) + "]"] if raw else []
    parts += [_json_char(cp) for cp in _MUST_ESCAPE if any(lo <= cp <= hi for lo, hi in allowed)]
    return "(" + " | ".join(parts) + ")" if parts else r"[^\0-\U0010ffff]"  # matches nothing


def _minus(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Inclusive code point ranges less the (sorted) holes."""
    out = []
    for lo, hi in ranges:
        for hole_lo, hole_hi in holes:
            if hole_lo <= hi and hole_hi >= lo:
                out += [(lo, hole_lo - 1)] if hole_lo > lo else []
                lo = max(lo, hole_hi + 1)
        out += [(lo, hi)] if lo <= hi else []
    return out


def _is_raw(cp: int) -> bool:
    return not any(lo <= cp <= hi for lo, hi in _NOT_RAW)


def _json_char(cp: int) -> str:
    """The JSON spellings of a character a string holds only escaped: json.dumps's, \\uXXXX."""
    spellings = dict.fromkeys([json.dumps(chr(cp))[1:-1], f"\\u{cp:04x}", f"\\u{cp:04X}"])
    return "(" + " | ".join(_ebnf_literal(s) for s in spellings) + ")"


def _ebnf_literal(text: str) -> str:
    return '"' + "".join(_ebnf_char(ord(c)) for c in text) + '"'


def _ebnf_char(cp: int) -> str:
    """A code point as xgrammar's EBNF reads it in a literal or a class (its \\x takes every
    hex digit that follows, so only the fixed-width escapes)."""
    if chr(cp).isascii() and chr(cp).isalnum():
        return chr(cp)
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


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
