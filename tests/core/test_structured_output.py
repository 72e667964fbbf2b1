"""core/structured_output.py with the scheduler: a request waits only for its own grammar, a
failed compile ends only its request, matchers follow the accepted tokens, reasoning is left
free, and the bitmask rows are the step's constrained rows."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrv2.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                         StructuredOutputsConfig)
from mrv2.core.grammar import GrammarCompiler
from mrv2.core.request import Request, RequestStatus
from mrv2.core.scheduler import Scheduler
from mrv2.core.structured_output import StructuredOutputManager
from mrv2.models.tokenizer import load_tokenizer
from mrv2.protocol import FinishReason, ModelRunnerOutput
from mrv2.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 2048
EOS = 1
THINK, END_THINK = 3, 4  # stand-ins: the test tokenizer's <|im_start|> and <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(str(tiny_llama))


@pytest.fixture(scope="module")
def grammar_compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [EOS], StructuredOutputsConfig())


def make_scheduler(monkeypatch, grammar_compiler, compile_gate=None, fail=False,
                   reasoning=(None, None), speculative_config=None) -> Scheduler:
    def fake_compile(self, params):
        if compile_gate is not None:
            compile_gate.wait(10)
        if fail:
            raise RuntimeError("compile failed on purpose")
        return (grammar_compiler.compile(params), *reasoning)

    monkeypatch.setattr(StructuredOutputManager, "_compile", fake_compile)
    config = EngineConfig(
        model_config=ModelConfig(model="fake", dtype=torch.float32, max_model_len=128,
                                 hf_config=SimpleNamespace(vocab_size=VOCAB)),
        cache_config=CacheConfig(block_size=4),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                         async_scheduling=False),
        speculative_config=speculative_config)
    return Scheduler(config, 64)


def request(req_id: str, prompt=(10, 11, 12), **constraint) -> Request:
    so = StructuredOutputsParams(**constraint) if constraint else None
    return Request(req_id, list(prompt), SamplingParams(max_tokens=20, structured_outputs=so),
                   eos_token_id=EOS, max_model_len=128)


def tokens_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def run(scheduler: Scheduler, sampled: dict[str, list[int]]):
    out = scheduler.schedule()
    grammar = scheduler.get_grammar_output(out)
    result = ModelRunnerOutput.build(out.req_ids, [sampled.get(r, [100]) for r in out.req_ids])
    return out, grammar, scheduler.update_from_output(out, result)


def test_request_waits_for_its_own_grammar_only(monkeypatch, grammar_compiler):
    gate = threading.Event()
    scheduler = make_scheduler(monkeypatch, grammar_compiler, compile_gate=gate)
    scheduler.add_request(request("json", json={"type": "integer"}))
    scheduler.add_request(request("free"))
    out, grammar, _ = run(scheduler, {})
    assert out.req_ids == ["free"] and grammar.num_rows == 0
    gate.set()
    scheduler.structured_outputs._threads.shutdown(wait=True)
    out, grammar, _ = run(scheduler, {})
    assert out.req_ids == ["free", "json"]
    assert grammar.rows.tolist() == [1] and grammar.bitmask.shape == (1, VOCAB // 32)


def test_failed_compile_ends_only_its_request(monkeypatch, grammar_compiler):
    scheduler = make_scheduler(monkeypatch, grammar_compiler, fail=True)
    scheduler.add_request(request("bad", regex="a+"))
    scheduler.add_request(request("free"))
    scheduler.structured_outputs._threads.shutdown(wait=True)
    out, _, outputs = run(scheduler, {})
    assert out.req_ids == ["free"] and "bad" in out.finished_req_ids
    failed = [o for o in outputs if o.request_id == "bad"]
    assert failed and failed[0].finish_reason == FinishReason.ERROR
    assert "bad" not in scheduler.requests and not scheduler.structured_outputs.has_live_requests


def test_matcher_follows_accepted_tokens_and_stops_the_request(monkeypatch, grammar_compiler,
                                                               tokenizer):
    scheduler = make_scheduler(monkeypatch, grammar_compiler)
    scheduler.add_request(request("c", choice=["yes", "no"]))
    scheduler.structured_outputs._threads.shutdown(wait=True)
    ids = tokens_of(tokenizer, "yes")
    for token in ids:
        _, grammar, outputs = run(scheduler, {"c": [token]})
        bits = np.unpackbits(grammar.bitmask.view(np.uint8), bitorder="little")
        assert bits[token] and not bits[EOS]  # the mask allowed exactly what came
    _, grammar, outputs = run(scheduler, {"c": [EOS]})
    assert np.unpackbits(grammar.bitmask.view(np.uint8), bitorder="little")[EOS]
    assert outputs[0].finish_reason == FinishReason.STOP and "c" not in scheduler.requests


def test_rejected_token_is_an_error_for_that_request(monkeypatch, grammar_compiler, tokenizer):
    scheduler = make_scheduler(monkeypatch, grammar_compiler)
    scheduler.add_request(request("c", choice=["yes"]))
    scheduler.add_request(request("free"))
    scheduler.structured_outputs._threads.shutdown(wait=True)
    _, _, outputs = run(scheduler, {"c": tokens_of(tokenizer, "no")[:1]})
    by_id = {o.request_id: o for o in outputs}
    assert by_id["c"].finish_reason == FinishReason.ERROR
    assert by_id["free"].finish_reason is None and "free" in scheduler.requests


@pytest.mark.parametrize("prompt, thinking", [((10, THINK, 11), True),
                                              ((10, THINK, 11, END_THINK, 12), False),
                                              ((10, 11), True)])
def test_reasoning_is_not_constrained(monkeypatch, grammar_compiler, tokenizer, prompt,
                                      thinking):
    """Until the end-of-reasoning token the request samples freely and its matcher does not
    move (a model with a reasoning parser thinks first, as in vLLM); a prompt whose template
    closed the reasoning (thinking disabled) is constrained from the first token."""
    scheduler = make_scheduler(monkeypatch, grammar_compiler, reasoning=(THINK, END_THINK))
    scheduler.add_request(request("r", prompt=prompt, choice=["yes"]))
    scheduler.structured_outputs._threads.shutdown(wait=True)
    if thinking:
        for token in (500, 501, END_THINK):  # free text, then the end of reasoning
            _, grammar, outputs = run(scheduler, {"r": [token]})
            assert grammar.num_rows == 0 and outputs[0].finish_reason is None
    for token in tokens_of(tokenizer, "yes"):
        _, grammar, outputs = run(scheduler, {"r": [token]})
        assert grammar.num_rows == 1 and outputs[0].finish_reason is None
    _, _, outputs = run(scheduler, {"r": [EOS]})
    assert outputs[0].finish_reason == FinishReason.STOP


def test_drafts_are_cut_where_the_grammar_stops_and_masked_one_row_each(
        monkeypatch, grammar_compiler, tokenizer):
    """A grammar keeps the run of drafts it accepts (up to one that completes it), and the
    verify step gets a mask per row: the next token's, then the one after each draft, none
    after the completing draft. Its matcher is rolled back: only kept tokens advance it."""
    import msgspec

    from executor.packed import int32_bytes
    from mrv2.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    scheduler = make_scheduler(monkeypatch, grammar_compiler, speculative_config=spec)
    scheduler.add_request(request("d", regex="[0-9]{3}"))
    scheduler.structured_outputs._threads.shutdown(wait=True)
    one, two, letter = (tokens_of(tokenizer, t)[-1] for t in ("1", "2", "a"))

    def step(sampled: list[int], drafts: list[int]):
        out = scheduler.schedule()
        grammar = scheduler.get_grammar_output(out)
        result = msgspec.structs.replace(
            ModelRunnerOutput.build(out.req_ids, [sampled]),
            num_draft_tokens_i32=int32_bytes([len(drafts)]),
            draft_token_ids_i32=int32_bytes(drafts), draft_pauses_i32=int32_bytes([0]))
        scheduler.update_from_output(out, result)
        return out, grammar

    step([one], [two, letter, two])  # the prefill samples "1"; "a" cuts the drafts to one
    request_ = scheduler.requests["d"]
    assert request_.num_draft_tokens == 1
    out, grammar = step([two, one], [two, EOS, two])  # verifies "2": kept, then "1"
    assert out.num_scheduled.tolist() == [2] and grammar.rows.tolist() == [0, 0]
    bits = np.unpackbits(grammar.bitmask.view(np.uint8), bitorder="little").reshape(2, -1)
    assert bits[0, two] and bits[1, two] and not bits[0, EOS] and not bits[0, letter]
    # "1", "2", "1" so far: the grammar's three digits are done, only EOS may follow, so of
    # the drafts [2, EOS, 2] none is valid.
    assert request_.num_draft_tokens == 0 and request_.output_token_ids == [one, two, one]


def test_verify_rows_after_a_completing_draft_are_not_masked(monkeypatch, grammar_compiler,
                                                             tokenizer):
    import msgspec

    from executor.packed import int32_bytes
    from mrv2.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    scheduler = make_scheduler(monkeypatch, grammar_compiler, speculative_config=spec)
    scheduler.add_request(request("d", regex="[0-9]{2}"))
    scheduler.structured_outputs._threads.shutdown(wait=True)
    one = tokens_of(tokenizer, "1")[-1]
    out = scheduler.schedule()
    scheduler.update_from_output(out, msgspec.structs.replace(
        ModelRunnerOutput.build(out.req_ids, [[one]]), num_draft_tokens_i32=int32_bytes([3]),
        draft_token_ids_i32=int32_bytes([one, EOS, one]), draft_pauses_i32=int32_bytes([0])))
    assert scheduler.requests["d"].num_draft_tokens == 2  # "1", then EOS completes it
    out = scheduler.schedule()
    grammar = scheduler.get_grammar_output(out)
    assert out.num_scheduled.tolist() == [3] and grammar.rows.tolist() == [0, 0]
    bits = np.unpackbits(grammar.bitmask.view(np.uint8), bitorder="little").reshape(2, -1)
    assert bits[0, one] and not bits[0, EOS] and bits[1, EOS] and not bits[1, one]
    outputs = scheduler.update_from_output(out, ModelRunnerOutput.build(out.req_ids,
                                                                        [[one, EOS, 7]]))
    assert outputs[0].new_token_ids == [one, EOS]
    assert outputs[0].finish_reason == FinishReason.STOP


def test_aborted_request_releases_its_grammar(monkeypatch, grammar_compiler):
    scheduler = make_scheduler(monkeypatch, grammar_compiler)
    scheduler.add_request(request("j", json_object=True))
    assert scheduler.structured_outputs.has_live_requests
    scheduler.finish_requests("j", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.structured_outputs.has_live_requests


def test_grammar_cache_bound_is_vllms_variable(monkeypatch):
    from mrv2.config import ConfigError
    from mrv2.core.structured_output import xgrammar_cache_limit_bytes

    monkeypatch.delenv("VLLM_XGRAMMAR_CACHE_MB", raising=False)
    assert xgrammar_cache_limit_bytes() == 512 << 20  # vLLM's default
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", "0")
    assert xgrammar_cache_limit_bytes() == 0
    for bad in ("-1", "lots", "1.5"):
        monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", bad)
        with pytest.raises(ConfigError, match=f"VLLM_XGRAMMAR_CACHE_MB={bad!r}"):
            make_scheduler(monkeypatch, None)  # at engine start, not at the first request
