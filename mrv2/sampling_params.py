"""SamplingParams: vLLM's names and defaults, validated on construction.

It is a msgspec Struct so that it crosses process boundaries inside the protocol structs
without pickling. Every invalid value raises ``ValueError`` naming the field and the value.
Checks that need the model's vocabulary size (token ids in ``logit_bias``,
``allowed_token_ids`` and ``stop_token_ids``) live in ``validate_for_vocab``, which the input
processor calls once it knows the model. As in vLLM, ``seed=-1`` means no seed and
``logprobs`` / ``prompt_logprobs`` = -1 the whole vocabulary, which the engine refuses when
the vocabulary exceeds its ``max_logprobs`` (LLMEngine.validate_request).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import msgspec

from mrv2.outputs import RequestOutputKind

MAX_LOGPROBS = 20
# Per-request entries in logit_bias; the sampler's per-slot bias table is at most this wide.
MAX_LOGIT_BIAS = 1024
# Below this a temperature is treated as greedy (vLLM's _SAMPLING_EPS): dividing logits by it
# would make the noise irrelevant anyway, and very small values overflow float32.
GREEDY_TEMPERATURE_EPS = 1e-5


class Interval(msgspec.Struct, frozen=True):
    """The accepted range of a real-valued sampling field. One definition serves the check in
    SamplingParams and the bound the server's OpenAPI schema publishes for the same field."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: object) -> bool:
        if not _is_real(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        """'in [-2, 2]', 'in (0, 1]', 'at least 0', 'finite and greater than 0'."""
        if math.isfinite(self.low) and math.isfinite(self.high):
            return (f"in {'(' if self.low_open else '['}{self.low:g}, "
                    f"{self.high:g}{')' if self.high_open else ']'}")
        if self.high_open:
            return f"finite and {'greater than' if self.low_open else 'at least'} {self.low:g}"
        return f"{'greater than' if self.low_open else 'at least'} {self.low:g}"

    @property
    def json_schema(self) -> dict[str, float]:
        """JSON Schema's keywords for the finite bounds (JSON numbers are finite)."""
        schema = {}
        if math.isfinite(self.low):
            schema["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if math.isfinite(self.high):
            schema["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        return schema


SAMPLING_RANGES = {
    "temperature": Interval(low=0.0),
    "top_p": Interval(low=0.0, high=1.0, low_open=True),
    "min_p": Interval(low=0.0, high=1.0),
    "presence_penalty": Interval(low=-2.0, high=2.0),
    "frequency_penalty": Interval(low=-2.0, high=2.0),
    "repetition_penalty": Interval(low=0.0, low_open=True, high_open=True),
}


# StructuredOutputsParams' constraints, of which a request sets exactly one.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """vLLM's constraint on a request's output: exactly one of a JSON schema (`json`, a dict or
    its JSON text), any JSON object (`json_object=True`), a regular expression, one of a list
    of strings (`choice`), a grammar (GBNF/EBNF with ``::=`` rules, or Lark) or an xgrammar
    structural tag (its JSON text). Whether the constraint compiles is checked by the input
    processor (core/grammar.py), before the request is queued."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # No whitespace between JSON tokens beyond what the schema needs (OR-ed with the engine's
    # StructuredOutputsConfig), so a weak model cannot spend its tokens on it.
    disable_any_whitespace: bool = False
    # JSON objects take no properties beyond those the schema lists, where the schema does
    # not say (OR-ed with the engine's setting).
    disable_additional_properties: bool = False
    # vLLM's: no fallback to another backend on failure. mrv2 has one backend, so a
    # constraint it cannot compile is always an error; accepted for compatibility.
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}"
                f"; got {', '.join(kinds) if kinds else 'none'}")
        if self.choice is not None:
            _require(bool(self.choice) and all(isinstance(c, str) for c in self.choice),
                     "structured_outputs.choice", self.choice,
                     "must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """The one constraint set: an entry of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # How the request's RequestOutputs are streamed (vLLM's; LLM.generate always returns
    # final outputs, LLMEngine.add_request honours it).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None  # vLLM's "no seed"
        _require(_is_int(self.output_kind) and self.output_kind in _OUTPUT_KINDS, "output_kind",
                 self.output_kind, "must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY)")
        self.output_kind = RequestOutputKind(self.output_kind)
        _require(_is_int(self.n) and self.n >= 1, "n", self.n, "must be at least 1")
        for name, interval in SAMPLING_RANGES.items():
            value = getattr(self, name)
            _require(value in interval, name, value, f"must be {interval.describe()}")
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k,
               "must be -1 (disable), 0 (disable) or at least 1")
        if self.seed is not None:
            _require(_is_int(self.seed), "seed", self.seed, "must be an integer or None")
        if self.max_tokens is not None:
            _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                   self.max_tokens, "must be at least 1")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "must be non-negative")
        if self.max_tokens is not None:
            _require(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:  # -1: the whole vocabulary (vLLM's), checked by the engine
                _require(_is_int(value) and -1 <= value <= MAX_LOGPROBS, name, value,
                       f"must be -1 (the whole vocabulary) or in [0, {MAX_LOGPROBS}]")
        if self.stop_token_ids is not None:
            _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                   self.stop_token_ids, "must be non-negative token ids")
        if self.stop is not None:
            _require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                   "must not contain empty strings")
        if self.logit_bias is not None:
            bias = self.logit_bias
            _require(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"<{len(bias)} entries>",
                   f"must have at most {MAX_LOGIT_BIAS} entries")
            for token, value in bias.items():
                _require(_is_int(token) and token >= 0, "logit_bias", {token: value},
                       "keys must be non-negative token ids")
                _require(_is_real(value) and math.isfinite(value), "logit_bias", {token: value},
                       "values must be finite numbers")
        if self.allowed_token_ids is not None:
            _require(len(self.allowed_token_ids) > 0, "allowed_token_ids", self.allowed_token_ids,
                   "must not be empty (it would allow no token at all); use None for no limit")
            _require(all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", self.allowed_token_ids, "must be non-negative token ids")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: every token id must be below ``vocab_size``."""
        for name in ("allowed_token_ids", "stop_token_ids"):
            ids = getattr(self, name)
            if ids:
                bad = [t for t in ids if t >= vocab_size]
                _require(not bad, name, bad,
                       f"token ids must be below the vocabulary size {vocab_size}")
        if self.logit_bias:
            bad = [t for t in self.logit_bias if t >= vocab_size]
            _require(not bad, "logit_bias", bad,
                   f"token ids must be below the vocabulary size {vocab_size}")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def decodes_by_argmax(self) -> bool:
        """Every token is the argmax of the raw logits and nothing else is read: greedy, no
        stage that changes the logits (bias, allowed ids, min_tokens, penalties), no logprobs,
        no grammar, no stop strings (found in text, after the tokens). Such a request can
        decode several tokens in one scheduled step (SchedulerConfig.num_scheduler_steps)."""
        return (self.sampling_type_greedy and not self.logit_bias
                and self.allowed_token_ids is None and self.min_tokens == 0
                and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and self.logprobs is None
                and self.prompt_logprobs is None and not self.stop
                and self.structured_outputs is None)

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


_OUTPUT_KINDS = frozenset(int(kind) for kind in RequestOutputKind)


class BeamSearchParams(msgspec.Struct, omit_defaults=True):
    """vLLM's beam search parameters (`LLM.beam_search`, entrypoints/beam_search.py). A bad
    value raises ValueError naming the field, here and again in `LLM.beam_search` (fields are
    mutable). `include_stop_str_in_output` is accepted and, as in vLLM's `LLM.beam_search`,
    changes nothing: the text is the decode of every token."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def require(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"BeamSearchParams.{name}={getattr(self, name)!r} is invalid: "
                                 f"{why}")

        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            require(_is_int(value) and value >= 1, name, "must be an integer of at least 1")
        require(_is_real(self.temperature) and self.temperature >= 0.0, "temperature",
                "must be non-negative")
        require(_is_real(self.length_penalty) and math.isfinite(self.length_penalty),
                "length_penalty", "must be a finite number")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """An int or float that is not NaN (every range check below fails on NaN anyway)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


def _require(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {why}")
