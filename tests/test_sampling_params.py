"""SamplingParams: vLLM defaults, validation naming the field, msgpack round trip."""

from __future__ import annotations

import math

import msgspec
import pytest

from mrv2.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams,
                                  StructuredOutputsParams)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1 and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
    assert p.min_p == 0.0 and p.max_tokens == 16 and p.min_tokens == 0
    assert p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.seed is None and p.stop is None and p.logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos
    assert not p.sampling_type_greedy


@pytest.mark.parametrize("field, value", [
    ("n", 0),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_k", -2),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("presence_penalty", -2.5),
    ("presence_penalty", 2.01),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("min_tokens", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", -2),
    ("prompt_logprobs", -2),
    ("output_kind", 3),
    ("output_kind", "delta"),
    ("output_kind", True),
    ("prompt_logprobs", 21),
    ("stop_token_ids", [3, -1]),
    ("stop", ["ok", ""]),
    ("stop", ""),
    ("top_k", 2.5),
    ("min_p", math.nan),
    ("top_p", math.nan),
    ("presence_penalty", math.nan),
    ("repetition_penalty", math.inf),
    ("seed", 1.5),
    ("logprobs", True),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {3: math.inf}),
    ("logit_bias", {3: math.nan}),
    ("logit_bias", {t: 0.0 for t in range(MAX_LOGIT_BIAS + 1)}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [4, -2]),
])
def test_invalid_values_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    # No max_tokens: no upper bound for min_tokens.
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=-1), dict(top_k=1),
    dict(min_p=0.0), dict(min_p=1.0), dict(presence_penalty=-2.0), dict(presence_penalty=2.0),
    dict(frequency_penalty=2.0), dict(repetition_penalty=0.01), dict(max_tokens=1),
    dict(logprobs=0), dict(logprobs=MAX_LOGPROBS), dict(prompt_logprobs=0), dict(stop=[]),
    dict(logit_bias={t: -100.0 for t in range(MAX_LOGIT_BIAS)}), dict(logit_bias={}),
    dict(allowed_token_ids=[0]), dict(seed=-5), dict(seed=2**70), dict(logprobs=-1),
    dict(prompt_logprobs=-1),
])
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_vllm_sentinels() -> None:
    # seed=-1 is vLLM's "no seed"; other negative seeds are seeds.
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert SamplingParams(seed=3).clone(seed=-1).seed is None
    # -1 asks for the whole vocabulary; the engine checks it against max_logprobs.
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1


def test_output_kind() -> None:
    from mrv2.outputs import RequestOutputKind
    from mrv2.sampling_params import RequestOutputKind as reexported

    assert reexported is RequestOutputKind  # vLLM's import path works too
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE  # vLLM's default
    p = SamplingParams(output_kind=1)
    assert p.output_kind is RequestOutputKind.DELTA
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(
        SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)), type=SamplingParams)
    assert decoded.output_kind is RequestOutputKind.FINAL_ONLY


def test_stop_string_becomes_list() -> None:
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {10: 1.0, 99_999: 2.0}),
    ("allowed_token_ids", [5, 100_000]),
    ("stop_token_ids", [100_001]),
])
def test_token_ids_outside_the_vocabulary(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})  # the vocabulary is unknown here
    params.validate_for_vocab(200_000)
    with pytest.raises(ValueError, match=rf"\b{field}\b.*vocabulary size 99999"):
        params.validate_for_vocab(99_999)


def test_validate_for_vocab_accepts_in_range_ids() -> None:
    SamplingParams(logit_bias={0: 1.0, 9: -1.0}, allowed_token_ids=[9], stop_token_ids=[0, 9]
                   ).validate_for_vocab(10)
    SamplingParams().validate_for_vocab(1)


def test_decodes_by_argmax() -> None:
    assert SamplingParams(temperature=0.0).decodes_by_argmax
    assert SamplingParams(top_k=1, stop_token_ids=[3], ignore_eos=True).decodes_by_argmax
    for changes in (dict(temperature=0.7), dict(logprobs=0), dict(prompt_logprobs=1),
                    dict(stop=["."]), dict(min_tokens=1), dict(logit_bias={1: 2.0}),
                    dict(allowed_token_ids=[1]), dict(repetition_penalty=1.1),
                    dict(presence_penalty=0.1), dict(frequency_penalty=0.1),
                    dict(structured_outputs=StructuredOutputsParams(regex="a+"))):
        assert not SamplingParams(**{"temperature": 0.0, **changes}).decodes_by_argmax, changes


def test_greedy() -> None:
    assert SamplingParams(temperature=1e-6).sampling_type_greedy
    assert SamplingParams(temperature=0.0).sampling_type_greedy
    assert SamplingParams(top_k=1).sampling_type_greedy
    assert not SamplingParams(top_k=2).sampling_type_greedy


def test_clone_validates_and_leaves_original() -> None:
    p = SamplingParams(temperature=0.5, stop=["x"])
    q = p.clone(max_tokens=3)
    assert q.max_tokens == 3 and q.temperature == 0.5 and q.stop == ["x"]
    assert p.max_tokens == 16
    with pytest.raises(ValueError, match="temperature"):
        p.clone(temperature=-1.0)


def test_msgpack_round_trip() -> None:
    p = SamplingParams(n=2, temperature=0.3, top_p=0.9, top_k=40, min_p=0.01, seed=2**40,
                       stop="end", stop_token_ids=[2, 7], ignore_eos=True, max_tokens=None,
                       min_tokens=3, logprobs=5, prompt_logprobs=0, presence_penalty=-1.5,
                       frequency_penalty=0.5, repetition_penalty=1.2,
                       include_stop_str_in_output=True, logit_bias={3: -1.5, 10: 2.0},
                       allowed_token_ids=[1, 2, 3], skip_special_tokens=False)
    data = msgspec.msgpack.encode(p)
    back = msgspec.msgpack.decode(data, type=SamplingParams)
    assert back == p
    assert back.stop == ["end"]
    assert back.logit_bias == {3: -1.5, 10: 2.0}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams()),
                                  type=SamplingParams) == SamplingParams()


def test_decoding_invalid_params_is_refused() -> None:
    data = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises((ValueError, msgspec.ValidationError)):
        msgspec.msgpack.decode(data, type=SamplingParams)


def test_interval_bounds_description_and_schema() -> None:
    from mrv2.sampling_params import Interval

    half_open = Interval(low=0.0, high=1.0, low_open=True)
    assert 0.0 not in half_open and 1e-12 in half_open and 1.0 in half_open
    assert 1.5 not in half_open and float("nan") not in half_open and True not in half_open
    assert half_open.describe() == "in (0, 1]"
    assert half_open.json_schema == {"exclusiveMinimum": 0.0, "maximum": 1.0}
    positive = Interval(low=0.0, low_open=True, high_open=True)
    assert 1e300 in positive and float("inf") not in positive and 0 not in positive
    assert positive.describe() == "finite and greater than 0"
    assert positive.json_schema == {"exclusiveMinimum": 0.0}
    at_least = Interval(low=-1.0)
    assert float("inf") in at_least and at_least.describe() == "at least -1"
    assert at_least.json_schema == {"minimum": -1.0}
