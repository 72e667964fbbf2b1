"""LLMEngine: the in-process add_request / step loop, aborts, and models without a tokenizer."""

from __future__ import annotations

import shutil

import pytest

from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.input_processor import PromptError
from mrv2.engine.llm_engine import LLMEngine, load_tokenizer
from mrv2.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), max_model_len=128, max_num_seqs=4,
                                device="cpu"))


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
    assert len(steps) == 6
    # final_only: one RequestOutput per request, when it finishes.
    assert [[o.request_id for o in s] for s in steps] == [[], [], [], ["text"], [], ["ids"]]
    text_out, ids_out = steps[3][0], steps[5][0]
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
    engine.add_request("a", {"prompt_token_ids": [5, 6]}, GREEDY, final_only=False)
    steps = run(engine)
    assert [len(s) for s in steps] == [1, 1, 1, 1]
    assert [len(s[0].outputs[0].token_ids) for s in steps] == [1, 2, 3, 4]
    assert [s[0].finished for s in steps] == [False, False, False, True]


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
