"""LLM.beam_search (vLLM's): greedy at beam_width=1, and equal to an independent beam search
over transformers' full-vocabulary logprobs of the same weights, EOS and length penalty
included."""

from __future__ import annotations

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.entrypoints.beam_search import BeamSearchOutput, get_beam_search_score
from mrv2.sampling_params import BeamSearchParams  # vLLM's import path

PROMPT = "def fibonacci(n):"
TOKEN_PROMPT = [1, 5, 9, 20, 33]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second intra-op thread only adds waiting on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    """tokens -> the next token's log-probabilities over the whole vocabulary (float64)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logprobs(tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            cache[key] = torch.log_softmax(logits.double(), dim=-1)
        return cache[key]

    return logprobs


def engine_is_clean(llm: LLM) -> bool:
    core = llm.llm_engine.engine_core
    return (core.scheduler.kv_cache_manager.usage == 0
            and core.executor.worker.runner.requests.num_active == 0
            and not core.has_unfinished_requests())


def reference(logprobs, prompt: list[int], width: int, max_tokens: int, eos: int,
              ignore_eos: bool, length_penalty: float) -> list[tuple[list[int], float, str]]:
    """Beam search written out: each beam's candidates are its 2 * width most likely next
    tokens; EOS (unless ignored) finishes a candidate; `width` best survive by the length-
    penalised score (length = all tokens but a final EOS); the best `width` of finished and
    surviving beams are the result, as (tokens, cumulative logprob, finish reason)."""
    def score(beam):
        length = len(beam[0]) - (beam[0][-1] == eos)
        return beam[1] / length ** length_penalty

    live, done = [(list(prompt), 0.0, "length")], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum, _reason in live:
            step = logprobs(tokens)
            for token in torch.topk(step, 2 * width).indices.tolist():
                child = (tokens + [token], cum + step[token].item())
                if token == eos and not ignore_eos:
                    done.append((*child, "stop"))
                else:
                    candidates.append((*child, "length"))
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(done + live, key=score, reverse=True)[:width]


def check(output: BeamSearchOutput, expected, prompt_len: int, llm: LLM,
          length_penalty: float) -> None:
    eos = llm.llm_engine.input_processor.eos_token_id
    got = [(s.tokens, s.cum_logprob, s.finish_reason) for s in output.sequences]
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert [g[2] for g in got] == [e[2] for e in expected]
    for (_, cum, _), (_, want, _) in zip(got, expected):
        assert cum == pytest.approx(want, abs=1e-4)
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos, length_penalty)
              for s in output.sequences]
    assert scores == sorted(scores, reverse=True)  # best first
    tokenizer = llm.get_tokenizer()
    for seq in output.sequences:
        assert seq.text == tokenizer.decode(seq.tokens)  # vLLM's: prompt and EOS included
        assert len(seq.logprobs) == len(seq.tokens) - prompt_len  # one dict per new token


def test_beam_width_1_is_greedy(llm):
    [out] = llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=6,
                                                       ignore_eos=True))
    [greedy] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True), use_tqdm=False)
    [seq] = out.sequences
    assert seq.tokens == greedy.prompt_token_ids + greedy.outputs[0].token_ids
    assert len(seq.logprobs) == 6 and seq.finish_reason == "length"
    assert engine_is_clean(llm)


@pytest.mark.parametrize("width", [2, 3])
def test_matches_reference_ignoring_eos(llm, hf_logprobs, width):
    params = BeamSearchParams(beam_width=width, max_tokens=4, ignore_eos=True)
    outputs = llm.beam_search([PROMPT, {"prompt_token_ids": TOKEN_PROMPT}], params)
    eos = llm.llm_engine.input_processor.eos_token_id
    prompt_ids = llm.get_tokenizer()(PROMPT).input_ids
    assert len(outputs) == 2
    for output, prompt in zip(outputs, [prompt_ids, TOKEN_PROMPT]):
        assert len(output.sequences) == width
        check(output, reference(hf_logprobs, prompt, width, 4, eos, True, 1.0), len(prompt),
              llm, 1.0)
    if width == 3:  # one prompt at a time: the same
        again = llm.beam_search([PROMPT, {"prompt_token_ids": TOKEN_PROMPT}], params,
                                concurrency_limit=1)
        assert [[s.tokens for s in o.sequences] for o in again] == \
            [[s.tokens for s in o.sequences] for o in outputs]
    assert engine_is_clean(llm)


@pytest.fixture
def likely_eos(llm, hf_logprobs, monkeypatch):
    """Make the prompt's second most likely next token the EOS, so that beams finish early."""
    step = hf_logprobs(TOKEN_PROMPT)
    eos = torch.topk(step, 2).indices[1].item()
    monkeypatch.setattr(llm.llm_engine.input_processor, "eos_token_id", eos)
    return eos


def test_eos_and_length_penalty_match_reference(llm, hf_logprobs, likely_eos):
    results = {}
    for length_penalty in (0.0, 1.0, 8.0):
        params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=length_penalty)
        [out] = llm.beam_search([{"prompt_token_ids": TOKEN_PROMPT}], params)
        expected = reference(hf_logprobs, TOKEN_PROMPT, 2, 3, likely_eos, False, length_penalty)
        check(out, expected, len(TOKEN_PROMPT), llm, length_penalty)
        results[length_penalty] = [(s.tokens, s.finish_reason) for s in out.sequences]
    # The test has teeth: a beam ended at EOS, and the penalty changed the ranking.
    assert any(reason == "stop" for r in results.values() for _, reason in r)
    assert len({repr(r) for r in results.values()}) > 1
    # ignore_eos: EOS is an ordinary token, every beam runs max_tokens.
    [out] = llm.beam_search([{"prompt_token_ids": TOKEN_PROMPT}],
                            BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    check(out, reference(hf_logprobs, TOKEN_PROMPT, 2, 3, likely_eos, True, 1.0),
          len(TOKEN_PROMPT), llm, 1.0)
    assert all(len(s.tokens) == len(TOKEN_PROMPT) + 3 for s in out.sequences)
    assert engine_is_clean(llm)


def test_score():
    # Length counts the prompt; a final EOS (id 2) does not count.
    assert get_beam_search_score([5, 6, 7, 8], -2.0, 2) == pytest.approx(-0.5)
    assert get_beam_search_score([5, 6, 7, 2], -2.0, 2) == pytest.approx(-2.0 / 3)
    assert get_beam_search_score([5, 6, 7, 8], -2.0, 2, 0.0) == pytest.approx(-2.0)
    assert get_beam_search_score([5, 6, 7, 8], -2.0, 2, 2.0) == pytest.approx(-2.0 / 16)
    assert get_beam_search_score([2, 6], -1.0, 2) == pytest.approx(-0.5)  # only the last


@pytest.mark.parametrize("field,value", [("beam_width", 0), ("beam_width", -1),
                                         ("max_tokens", 0), ("beam_width", 1.5),
                                         ("temperature", -1.0)])
def test_bad_params(field, value):
    kwargs = {"beam_width": 2, "max_tokens": 3, field: value}
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field}="):
        BeamSearchParams(**kwargs)


def test_bad_params_at_call(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    params.max_tokens = 0  # mutated after construction: caught by beam_search
    with pytest.raises(ValueError, match="BeamSearchParams.max_tokens="):
        llm.beam_search([PROMPT], params)
    # 2 * beam_width logprobs a step must fit max_logprobs (20).
    with pytest.raises(ValueError, match="BeamSearchParams.beam_width=11"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=11, max_tokens=1))
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=1),
                        lora_request=object())
    assert engine_is_clean(llm)


def test_stops_at_max_model_len_and_takes_text_prompt_dicts(llm):
    # 254 prompt tokens, max_model_len 256: two tokens fit, whatever max_tokens says.
    long_prompt = {"prompt_token_ids": [(7 * i) % 500 + 3 for i in range(254)]}
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    long, text, plain = llm.beam_search([long_prompt, {"prompt": PROMPT}, PROMPT], params,
                                        use_tqdm=True)
    assert [len(s.tokens) for s in long.sequences] == [256, 256]
    assert all(s.finish_reason == "length" for s in long.sequences)
    assert [s.tokens for s in text.sequences] == [s.tokens for s in plain.sequences]
    assert engine_is_clean(llm)
