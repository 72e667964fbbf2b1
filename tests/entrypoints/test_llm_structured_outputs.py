"""Structured outputs end to end on a random-weight model: the grammar, not the weights,
guarantees every output. Sampled at temperature 1 so the model would wander anywhere; every
string and number is bounded so that a grammar can finish within max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from mrv2 import LLM, SamplingParams
from mrv2.core.grammar import GrammarError
from mrv2.sampling_params import StructuredOutputsParams

SCHEMAS = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object",
     "properties": {"point": {"type": "object",
                              "properties": {"x": {"type": "number", "minimum": -1,
                                                   "maximum": 1},
                                             "y": {"type": "number", "minimum": 0,
                                                   "maximum": 100}},
                              "required": ["x", "y"]},
                    "color": {"enum": ["red", "green", "blue"]}},
     "required": ["point", "color"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 1, "maxItems": 4},
    {"type": "object",
     "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 3,
                                                       "items": {"enum": ["a", "b", "c"]}},
                    "nothing": {"type": "null"}},
     "required": ["ok", "tags", "nothing"]},
    {"type": "object", "properties": {"kind": {"const": "leaf"},
                                      "weight": {"type": "integer", "exclusiveMinimum": 5}},
     "required": ["kind", "weight"]},
]
PROMPT = "def main():"
MAX_TOKENS = 160


def params(seed: int, **constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                          structured_outputs=StructuredOutputsParams(
                              disable_any_whitespace=True, **constraint))


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, tiny_llama):
    return LLM(str(tiny_llama), max_model_len=512, max_num_seqs=16,
               async_scheduling=request.param)


def check_json(text: str, schema: dict) -> None:
    # A strict parser: core/grammar.py rewrites xgrammar's bounded-string rule, which admitted
    # raw control characters (issue 47).
    jsonschema.validate(json.loads(text), schema)


def test_json_schemas_in_a_mixed_batch(llm):
    """Every schema twice, with unconstrained requests between them, in one batch."""
    batch = []
    for i, schema in enumerate(SCHEMAS * 2):
        batch.append(params(i, json=schema))
        batch.append(SamplingParams(temperature=1.0, seed=i, max_tokens=24))
    outs = llm.generate([PROMPT] * len(batch), batch, use_tqdm=False)
    for i, out in enumerate(outs[::2]):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        check_json(completion.text, SCHEMAS[i % len(SCHEMAS)])
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs[1::2])


def test_choice_regex_and_grammars(llm):
    choices = ["yes", "no", 'say "maybe"', "peut-être"]
    lark = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-z]{2,5}/'
    batch = ([params(i, choice=choices) for i in range(4)]
             + [params(i, regex=r"[0-9]{3}-[a-z]{2,4}") for i in range(4)]
             + [params(i, grammar=lark) for i in range(3)]
             + [params(i, grammar='root ::= "(" [0-9]{1,6} ")"') for i in range(2)])
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(batch), batch, use_tqdm=False)]
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    assert all(o.text in choices for o in outs[:4])
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.text) for o in outs[4:8])
    assert all(re.fullmatch(r"(hello|hi) [a-z]{2,5}", o.text) for o in outs[8:11])
    assert all(re.fullmatch(r"\([0-9]{1,6}\)", o.text) for o in outs[11:13])


def test_json_object_is_an_object(llm):
    """json_object has no bound on keys or values, so an output may run out of tokens; those
    that finish parse as JSON objects (xgrammar's builtin JSON grammar would allow any value)."""
    batch = [params(i, json_object=True) for i in range(6)]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(batch), batch, use_tqdm=False)]
    done = [o.text for o in outs if o.finish_reason == "stop"]
    assert done and all(o.text.startswith("{") for o in outs)
    assert all(isinstance(json.loads(text), dict) for text in done)


def test_seeded_output_does_not_depend_on_the_batch(llm):
    alone = llm.generate(PROMPT, params(7, json=SCHEMAS[1]), use_tqdm=False)[0].outputs[0]
    others = [params(i, json=SCHEMAS[i % 3]) for i in range(5)]
    mixed = llm.generate([PROMPT] * 6, [*others[:3], params(7, json=SCHEMAS[1]), *others[3:]],
                         use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone.token_ids


def test_grammar_that_cannot_finish_ends_with_length(llm):
    out = llm.generate(PROMPT, SamplingParams(
        temperature=1.0, seed=0, max_tokens=5,
        structured_outputs=StructuredOutputsParams(regex="a{20}")), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text == "a" * 5


@pytest.mark.parametrize("constraint, field", [
    ({"json": {"type": "objectx"}}, "json"),
    ({"json": "{not json"}, "json"),
    ({"regex": "a(b"}, "regex"),
    ({"grammar": 'root ::= "a" |'}, "grammar"),
    ({"structural_tag": '{"x": 1}'}, "structural_tag"),
])
def test_invalid_constraint_is_refused_before_queueing(llm, constraint, field):
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(GrammarError, match=f"structured_outputs.{field}"):
        llm.generate(PROMPT, bad, use_tqdm=False)
    core = llm.llm_engine.engine_core
    assert not core.has_unfinished_requests()
    # The engine goes on as before.
    assert llm.generate(PROMPT, params(0, choice=["x", "y"]),
                        use_tqdm=False)[0].outputs[0].text in ("x", "y")


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json_object=False)


def test_under_preemption(tiny_llama):
    """A KV pool too small for the batch: requests are preempted and resumed, and their
    matchers stay in step with their outputs. 18 blocks hold one request's whole 256 tokens
    but not the 8 prompts' ~24 blocks: whatever the sampled lengths (they are floats away from
    changing with the thread count), running requests outgrow the pool."""
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    llm = LLM(str(tiny_llama), max_model_len=256, max_num_batched_tokens=64,
              kv_cache_memory_gb=18 * block_bytes / (1 << 30))
    batch = [params(i, json=SCHEMAS[i % len(SCHEMAS)]) for i in range(8)]
    # Distinct prompts of ~3 blocks each: no prefix-cache sharing.
    outs = llm.generate([f"{i}: " + PROMPT * 8 for i in range(len(batch))], batch,
                        use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for i, out in enumerate(outs):
        assert out.outputs[0].finish_reason == "stop"
        check_json(out.outputs[0].text, SCHEMAS[i % len(SCHEMAS)])
