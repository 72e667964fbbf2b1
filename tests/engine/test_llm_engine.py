"""LLMEngine: the in-process add_request / step loop, aborts, and models without a tokenizer."""

from __future__ import annotations

import shutil

import pytest

from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.input_processor import PromptError
from mrv2.engine.llm_engine import LLMEngine, child_sampling_params
from mrv2.models.tokenizer import load_tokenizer
from mrv2.outputs import RequestOutputKind
from mrv2.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_engine(model_dir) -> LLMEngine:
    # Synchronous scheduling: these tests check which step each output arrives in.
    return LLMEngine(EngineArgs(model=str(model_dir), max_model_len=128, max_num_seqs=4,
                                device="cpu", async_scheduling=False))


@pytest.fixture
def engine(tiny_llama):
    eng = make_engine(tiny_llama)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def no_tokenizer_dir(tiny_llama, tmp_path_factory):
    """tiny_llama's config and weights, without any tokenizer file."""
    d = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_llama / name, d / name)
    return d


def run(engine: LLMEngine, max_steps: int = 100):
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
        assert len(steps) < max_steps
    return steps


def runner_slots_in_use(engine: LLMEngine) -> int:
    return engine.engine_core.executor.worker.runner.requests.num_active


def test_step_loop_to_completion(engine):
    engine.add_request("text", "hello world", GREEDY)
    engine.add_request("ids", {"prompt_token_ids": [5, 17, 300]},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert engine.has_unfinished_requests()
    steps = run(engine)
    # final_only: one RequestOutput per request, when it finishes; with nobody streaming a
    # step runs several decode steps (core/decode_steps.py), so fewer than the 6 tokens.
    finished = [[o.request_id for o in s] for s in steps]
    assert [i for s in finished for i in s] == ["text", "ids"] and finished[-1] == ["ids"]
    assert len(steps) < 6
    text_out, ids_out = (o for s in steps for o in s)
    assert text_out.prompt == "hello world"
    assert text_out.prompt_token_ids == engine.tokenizer("hello world").input_ids
    assert ids_out.prompt is None and ids_out.prompt_token_ids == [5, 17, 300]
    for out, n in ((text_out, 4), (ids_out, 6)):
        assert out.finished
        [completion] = out.outputs
        assert len(completion.token_ids) == n
        assert completion.finish_reason == "length"
        assert completion.text == engine.tokenizer.decode(completion.token_ids,
                                                          skip_special_tokens=True)


def test_same_prompt_same_greedy_tokens(engine):
    engine.add_request("a", {"prompt_token_ids": [5, 17, 300]}, GREEDY)
    first = run(engine)[-1][0].outputs[0].token_ids
    engine.add_request("b", {"prompt_token_ids": [5, 17, 300]}, GREEDY)
    engine.add_request("c", {"prompt_token_ids": [9, 9]}, GREEDY)
    outs = {o.request_id: o for s in run(engine) for o in s}
    assert outs["b"].outputs[0].token_ids == first


def test_cumulative_outputs(engine):
    engine.add_request("a", {"prompt_token_ids": [5, 6]}, GREEDY, RequestOutputKind.CUMULATIVE)
    steps = run(engine)
    assert [len(s) for s in steps] == [1, 1, 1, 1]
    assert [len(s[0].outputs[0].token_ids) for s in steps] == [1, 2, 3, 4]
    assert [s[0].finished for s in steps] == [False, False, False, True]


def test_delta_outputs(engine):
    engine.add_request("f", {"prompt_token_ids": [5, 6]}, GREEDY)
    final = run(engine)[-1][0].outputs[0]
    engine.add_request("d", {"prompt_token_ids": [5, 6]}, GREEDY, RequestOutputKind.DELTA)
    deltas = [s[0].outputs[0] for s in run(engine)]
    assert [len(d.token_ids) for d in deltas] == [1, 1, 1, 1]
    assert sum((d.token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.text for d in deltas) == final.text


def greedy_text(engine, prompt, max_tokens=24):
    engine.add_request("base", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True))
    return run(engine)[-1][0].outputs[0]


def test_stop_string_aborts_the_request_in_the_core(engine):
    prompt = {"prompt_token_ids": [5, 17, 300]}
    base = greedy_text(engine, prompt)
    # A stop string that first occurs around the middle of the text.
    start = len(base.text) // 2
    stop = next(base.text[i:i + 2] for i in range(start, len(base.text))
                if base.text.find(base.text[i:i + 2]) == i)
    engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True, stop=[stop]))
    scheduler = engine.engine_core.scheduler
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    [out] = outs
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == base.text[:base.text.index(stop)]
    assert len(completion.token_ids) < len(base.token_ids)
    assert completion.token_ids == base.token_ids[:len(completion.token_ids)]
    # Aborted in the core at once: no blocks held; the slot is freed by the next step.
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache_usage == 0
    engine.step()
    assert runner_slots_in_use(engine) == 0 and not engine.engine_core.has_unfinished_requests()


def test_child_sampling_params():
    seeded = child_sampling_params(SamplingParams(n=3, seed=10, temperature=0.5))
    assert [(p.n, p.seed, p.temperature) for p in seeded] == [(1, 10, 0.5), (1, 11, 0.5),
                                                               (1, 12, 0.5)]
    unseeded = child_sampling_params(SamplingParams(n=2))
    assert [(p.n, p.seed) for p in unseeded] == [(1, None), (1, None)]


def test_n_fans_out_into_core_requests(engine):
    params = SamplingParams(n=3, seed=5, max_tokens=4, ignore_eos=True)
    engine.add_request("p", "hello", params)
    core = engine.engine_core.scheduler.requests
    assert sorted(core) == ["0_p", "1_p", "2_p"]
    assert [core[f"{i}_p"].sampling_params.seed for i in range(3)] == [5, 6, 7]
    assert all(r.sampling_params.n == 1 for r in core.values())
    assert len({tuple(r.prompt_token_ids) for r in core.values()}) == 1
    outs = [o for s in run(engine) for o in s]
    [out] = outs
    assert out.request_id == "p" and out.finished and out.prompt == "hello"
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 4 for c in out.outputs)


def test_abort_parent_aborts_all_samples(engine):
    engine.add_request("p", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.add_request("q", {"prompt_token_ids": [8]}, GREEDY)
    engine.step()
    assert runner_slots_in_use(engine) == 4
    engine.abort_request(["p"])
    assert sorted(engine.engine_core.scheduler.requests) == ["q"]
    outs = [o for s in run(engine) for o in s]
    assert [o.request_id for o in outs] == ["q"]
    engine.step()
    assert runner_slots_in_use(engine) == 0
    assert engine.engine_core.scheduler.kv_cache_usage == 0


def test_failed_add_leaves_nothing_behind(engine, monkeypatch):
    add = engine.engine_core.add_request
    calls = []

    def flaky_add(request):
        calls.append(request.request_id)
        if len(calls) == 2:
            raise ValueError("no room")
        add(request)

    monkeypatch.setattr(engine.engine_core, "add_request", flaky_add)
    with pytest.raises(ValueError, match="no room"):
        engine.add_request("p", "hello", SamplingParams(n=3))
    assert calls == ["0_p", "1_p"]
    assert not engine.has_unfinished_requests()
    assert not engine.engine_core.scheduler.has_unfinished_requests()
    monkeypatch.undo()
    engine.add_request("p", "hello", SamplingParams(n=2, max_tokens=2))
    [[out]] = [s for s in run(engine) if s]
    assert len(out.outputs) == 2


def test_abort_request(engine):
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0.0, max_tokens=50))
    engine.add_request("b", "hello", GREEDY)
    engine.step()
    assert runner_slots_in_use(engine) == 2
    engine.abort_request(["a"])
    outs = [o for s in run(engine) for o in s]
    assert [o.request_id for o in outs] == ["b"]
    assert len(outs[0].outputs[0].token_ids) == 4
    # The engine stays usable, and the aborted id can be reused.
    engine.add_request("a", {"prompt_token_ids": [8]}, GREEDY)
    assert [o.request_id for s in run(engine) for o in s] == ["a"]


def test_abort_all_frees_runner_slots(engine):
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.step()
    engine.abort_request(["a"])
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert runner_slots_in_use(engine) == 0


def test_bad_request_leaves_engine_untouched(engine):
    engine.add_request("a", {"prompt_token_ids": [5]}, GREEDY)
    with pytest.raises(ValueError, match="'a'"):
        engine.add_request("a", {"prompt_token_ids": [6]}, GREEDY)
    with pytest.raises(PromptError):
        engine.add_request("b", "", GREEDY)
    with pytest.raises(PromptError):
        engine.add_request("c", {"prompt_token_ids": [5] * 128}, GREEDY)
    outs = [o for s in run(engine) for o in s]
    assert [o.request_id for o in outs] == ["a"]
    assert outs[0].prompt_token_ids == [5]


def test_validate_request_adds_nothing(engine):
    request, text = engine.validate_request("v", "hello", GREEDY)
    assert text == "hello" and request.request_id == "v"
    assert not engine.has_unfinished_requests()
    assert not engine.engine_core.has_unfinished_requests()


def test_model_without_tokenizer(no_tokenizer_dir):
    assert load_tokenizer(str(no_tokenizer_dir)) is None
    engine = make_engine(no_tokenizer_dir)
    try:
        assert engine.tokenizer is None
        with pytest.raises(PromptError, match="tokenizer.*prompt_token_ids"):
            engine.add_request("t", "hello", GREEDY)
        assert not engine.has_unfinished_requests()
        engine.add_request("ids", {"prompt_token_ids": [5, 17, 300]}, GREEDY)
        [[out]] = [s for s in run(engine) if s]
        assert out.finished and len(out.outputs[0].token_ids) == 4
        assert out.outputs[0].text == ""
    finally:
        engine.shutdown()
