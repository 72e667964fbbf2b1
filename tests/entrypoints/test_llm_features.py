"""LLM end to end: stop strings, n > 1, streaming through the engine, LLM.chat."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.outputs import RequestOutputKind

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=256, max_num_seqs=8)


def engine_is_clean(llm: LLM) -> bool:
    core = llm.llm_engine.engine_core
    return (core.scheduler.kv_cache_manager.usage == 0
            and core.executor.worker.runner.requests.num_active == 0
            and not core.has_unfinished_requests())


def greedy(max_tokens=40, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def base(llm):
    """The greedy completion of PROMPT, and a stop string first seen in its middle."""
    out = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    text = out.text
    start = next(i for i in range(len(text) // 2, len(text) - 3)
                 if text.find(text[i:i + 3]) == i and "\ufffd" not in text[:i + 3])
    return out, text[start:start + 3]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string(llm, base, include):
    full, stop = base
    [out] = llm.generate(PROMPT, greedy(stop=["\x00unused", stop],
                                        include_stop_str_in_output=include), use_tqdm=False)
    completion = out.outputs[0]
    cut = full.text.index(stop) + (len(stop) if include else 0)
    assert completion.text == full.text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    n = len(completion.token_ids)
    assert n < len(full.token_ids) and completion.token_ids == full.token_ids[:n]
    # The request was aborted in the core: its KV blocks and runner slot are free.
    assert engine_is_clean(llm)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streaming_with_stop_string_through_the_engine(llm, base, kind):
    full, stop = base
    engine = llm.llm_engine
    engine.add_request("stream", PROMPT, greedy(stop=[stop]), kind)
    updates = []
    while engine.has_unfinished_requests():
        updates += [o.outputs[0] for o in engine.step()]
    want = full.text[:full.text.index(stop)]
    shown = ""
    for update in updates:
        shown = shown + update.text if kind == RequestOutputKind.DELTA else update.text
        # Never a stop string, a prefix of it that later matched, or any text after it.
        assert want.startswith(shown) and stop not in shown
    assert shown == want and updates[-1].stop_reason == stop
    assert len(updates) > 3  # it really streamed
    # The aborted request's id (and, with async scheduling, a step in flight) drain in a
    # bounded number of empty steps.
    for _ in range(4):
        if not engine.engine_core.has_unfinished_requests():
            break
        assert engine.step() == []
    assert engine_is_clean(llm)


def test_n_seeded_differs_and_reproduces(llm):
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=12, ignore_eos=True)
    [first] = llm.generate(PROMPT, params, use_tqdm=False)
    [again] = llm.generate(PROMPT, params, use_tqdm=False)
    tokens = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(t) for t in tokens}) == 3
    assert [c.token_ids for c in again.outputs] == tokens
    assert [c.text for c in again.outputs] == [c.text for c in first.outputs]
    # Sample i is the request with seed + i.
    for i, want in enumerate(tokens):
        [single] = llm.generate(PROMPT, params.clone(n=1, seed=11 + i), use_tqdm=False)
        assert single.outputs[0].token_ids == want
    assert engine_is_clean(llm)


def test_n_greedy_gives_identical_samples(llm, base):
    full, _ = base
    [out] = llm.generate(PROMPT, greedy(n=4), use_tqdm=False)
    assert len(out.outputs) == 4
    assert all(c.token_ids == full.token_ids and c.text == full.text for c in out.outputs)


def test_n_unseeded_samples_differ(llm):
    [out] = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_n_with_stop_strings_and_several_prompts(llm, base):
    full, stop = base
    outs = llm.generate([PROMPT, {"prompt_token_ids": [5, 6, 7]}],
                        [greedy(n=2, stop=[stop]), greedy(max_tokens=5)], use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 1]
    for c in outs[0].outputs:
        assert c.text == full.text[:full.text.index(stop)] and c.stop_reason == stop
    assert len(outs[1].outputs[0].token_ids) == 5
    assert llm.last_stats["num_output_tokens"] == sum(
        len(c.token_ids) for o in outs for c in o.outputs)
    assert engine_is_clean(llm)


# -- chat --------------------------------------------------------------------------------

CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hi."}]


def test_chat_applies_the_template(llm):
    tokenizer = llm.get_tokenizer()
    [out] = llm.chat(CONVERSATION, greedy(max_tokens=6), use_tqdm=False)
    rendered = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert out.prompt == rendered
    # Exactly one BOS: the template has none, the encoder adds it.
    assert out.prompt_token_ids == tokenizer(rendered).input_ids
    assert out.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    [same] = llm.generate(rendered, greedy(max_tokens=6), use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 6


def test_chat_batch_of_conversations_and_options(llm):
    tokenizer = llm.get_tokenizer()
    other = [{"role": "user", "content": "Another one."}]
    outs = llm.chat([CONVERSATION, other], greedy(max_tokens=3), use_tqdm=False)
    assert len(outs) == 2 and outs[1].prompt.endswith("<|im_start|>assistant\n")
    [no_gen] = llm.chat(other, greedy(max_tokens=3), add_generation_prompt=False,
                        use_tqdm=False)
    assert no_gen.prompt == "<|im_start|>user\nAnother one.<|im_end|>\n"
    # A template that writes the BOS itself does not get a second one.
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n" \
               "{% endfor %}"
    [custom] = llm.chat(other, greedy(max_tokens=3), chat_template=template, use_tqdm=False)
    assert custom.prompt == "<|begin_of_text|>[user] Another one.\n"
    assert custom.prompt_token_ids == tokenizer(custom.prompt).input_ids[1:]
    assert custom.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    # tools reach the template, as vLLM's LLM.chat(tools=...).
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    listed = "{% for t in tools %}<{{ t.function.name }}>{% endfor %}" + template
    [with_tools] = llm.chat(other, greedy(max_tokens=3), chat_template=listed, tools=tools,
                            use_tqdm=False)
    assert with_tools.prompt == "<lookup><|begin_of_text|>[user] Another one.\n"


def test_chat_errors(llm, monkeypatch):
    tokenizer = llm.get_tokenizer()
    for bad in ([], "hello", [{"content": "no role"}], [[]], {"role": "user"}):
        with pytest.raises(ValueError):
            llm.chat(bad, use_tqdm=False)
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CONVERSATION, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
