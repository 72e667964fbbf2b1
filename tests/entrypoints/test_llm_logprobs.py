"""Logprobs and prompt logprobs through LLM.generate, against log_softmax of transformers' fp32
logits at the same positions (within 1e-4): ids, values and ranks of the sampled (or prompt)
token and of the top-k, in vLLM's order (sampled token first)."""

from __future__ import annotations

import random

import pytest
import torch

from mrv2 import LLM, Logprob, SamplingParams
from mrv2.outputs import RequestOutputKind

MAX_BATCHED = 32  # prompts longer than this are prefilled in chunks
rng = random.Random(4)
LONG_PROMPT = [rng.randrange(3, 2000) for _ in range(100)]  # 4 chunks
SHORT_PROMPT = [rng.randrange(3, 2000) for _ in range(9)]
TEXT_PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=MAX_BATCHED)


@pytest.fixture(scope="module")
def hf_log_softmax(tiny_llama):
    """seq -> [len(seq), vocab] float64 log_softmax of transformers' fp32 logits (/ T)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def run(seq: list[int], temperature: float = 1.0) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([seq])).logits[0]
        return torch.log_softmax(logits.double() / temperature, dim=-1)

    return run


def check_entry(entry: dict[int, Logprob], row: torch.Tensor, token: int, k: int,
                tokenizer) -> None:
    """One position's dict against the reference row: `token` first, then the top-k."""
    top = row.topk(k)
    top_ids = top.indices.tolist()
    assert list(entry) == [token] + [t for t in top_ids if t != token]
    for rank, (t, value) in enumerate(zip(top_ids, top.values.tolist()), start=1):
        assert abs(entry[t].logprob - value) < 1e-4 and entry[t].rank == rank
    assert abs(entry[token].logprob - row[token].item()) < 1e-4
    if token not in top_ids:
        assert entry[token].rank == int((row >= row[token]).sum())
    for t, lp in entry.items():
        assert lp.decoded_token == tokenizer.decode([t])


def assert_same(a: list[dict[int, Logprob] | None], b: list[dict[int, Logprob] | None],
                tol: float = 1e-5) -> None:
    """Same entries (ids in order, ranks, texts) and values within `tol`: the same request in
    another batch runs through matmuls of other shapes, which round differently."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is None:
            continue
        assert list(x) == list(y)
        for t in x:
            assert x[t].rank == y[t].rank and x[t].decoded_token == y[t].decoded_token
            assert abs(x[t].logprob - y[t].logprob) < tol


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("params", [
    greedy(logprobs=5),
    SamplingParams(temperature=0.8, seed=3, logprobs=4, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=9, top_k=20, logprobs=20, max_tokens=6,
                   ignore_eos=True),
])
def test_sample_logprobs_match_transformers(llm, hf_log_softmax, params):
    prompts = [{"prompt_token_ids": LONG_PROMPT}, {"prompt_token_ids": SHORT_PROMPT}]
    tokenizer = llm.get_tokenizer()
    for out in llm.generate(prompts, params, use_tqdm=False):
        [completion] = out.outputs
        tokens = completion.token_ids
        assert len(completion.logprobs) == len(tokens) == params.max_tokens
        assert out.prompt_logprobs is None  # not asked for
        ref = hf_log_softmax(out.prompt_token_ids + tokens)
        start = len(out.prompt_token_ids) - 1
        for i, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
            check_entry(entry, ref[start + i], token, params.logprobs, tokenizer)
        want = sum(entry[t].logprob for t, entry in zip(tokens, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(want, abs=1e-6)


def test_logprobs_zero_is_the_sampled_token_only(llm, hf_log_softmax):
    [out] = llm.generate(TEXT_PROMPT, greedy(logprobs=0), use_tqdm=False)
    completion = out.outputs[0]
    ref = hf_log_softmax(out.prompt_token_ids + completion.token_ids)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert list(entry) == [token] and entry[token].rank == 1  # greedy: the argmax
        row = ref[len(out.prompt_token_ids) - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
    [plain] = llm.generate(TEXT_PROMPT, greedy(), use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.outputs[0].token_ids == completion.token_ids


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_transformers_in_chunks(llm, hf_log_softmax, k):
    """A 100-token prompt runs in 32-token chunks beside another request; every position's
    logits are used, and a repeat (that the prefix cache would serve) gives the same."""
    tokenizer = llm.get_tokenizer()
    params = greedy(max_tokens=3, prompt_logprobs=k)
    outs = llm.generate([{"prompt_token_ids": LONG_PROMPT}, {"prompt_token_ids": SHORT_PROMPT}],
                        params, use_tqdm=False)
    for out, prompt in zip(outs, (LONG_PROMPT, SHORT_PROMPT)):
        assert out.outputs[0].logprobs is None
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        ref = hf_log_softmax(prompt)
        for p in range(1, len(prompt)):
            check_entry(out.prompt_logprobs[p], ref[p - 1], prompt[p], k, tokenizer)
    stats = llm.llm_engine.engine_core.scheduler.prefix_cache_stats
    stats.reset()
    [again] = llm.generate({"prompt_token_ids": LONG_PROMPT}, params, use_tqdm=False)
    assert stats.hits == 0  # prompt logprobs skip the prefix cache
    assert_same(again.prompt_logprobs, outs[0].prompt_logprobs)
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    llm.generate({"prompt_token_ids": LONG_PROMPT}, greedy(max_tokens=1), use_tqdm=False)
    assert stats.hits > 0  # without them the cache serves the prompt


def test_prompt_logprobs_are_computed_in_bounded_chunks(llm, monkeypatch):
    """Never more than chunk_size rows of logits at once; a batch without prompt logprobs
    computes none beyond its rows' last tokens."""
    runner = llm.llm_engine.engine_core.executor.worker.runner
    model = runner.model
    sizes: list[int] = []
    original = model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        sizes.append(hidden.shape[0])
        return original(hidden)

    monkeypatch.setattr(model, "compute_logits", record)
    monkeypatch.setattr(runner.prompt_logprobs, "chunk_size", 8)
    llm.generate({"prompt_token_ids": LONG_PROMPT}, greedy(max_tokens=2, prompt_logprobs=1),
                 use_tqdm=False)
    prompt_chunks = [n for n in sizes if n > 1]
    assert max(prompt_chunks) == 8 and sum(prompt_chunks) >= len(LONG_PROMPT) - 8
    assert not runner.prompt_logprobs  # nothing tracked once the prompt is done
    sizes.clear()
    llm.generate({"prompt_token_ids": LONG_PROMPT}, greedy(max_tokens=2), use_tqdm=False)
    assert sizes and all(n == 1 for n in sizes)  # the last token of each row only


def test_async_scheduling_gives_identical_logprobs(llm, tiny_llama):
    """Greedy + logprobs with async scheduling on and off; a stop token ends a request early
    (with async scheduling one more token was sampled: it is dropped with its logprobs)."""
    sync = LLM(str(tiny_llama), max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=MAX_BATCHED, async_scheduling=False)
    prompts = [{"prompt_token_ids": LONG_PROMPT}, {"prompt_token_ids": SHORT_PROMPT},
               TEXT_PROMPT]
    base = sync.generate(prompts, greedy(logprobs=3, prompt_logprobs=2), use_tqdm=False)
    stop_id = base[2].outputs[0].token_ids[4]
    params = [greedy(logprobs=3, prompt_logprobs=2)] * 2 + [
        greedy(logprobs=3, stop_token_ids=[stop_id])]
    for engine in (llm, sync):
        outs = engine.generate(prompts, params, use_tqdm=False)
        for out, ref in zip(outs, base):
            completion, want = out.outputs[0], ref.outputs[0]
            n = len(completion.token_ids)
            assert len(completion.logprobs) == n
            assert completion.token_ids == want.token_ids[:n]
            assert_same(completion.logprobs, want.logprobs[:n])
        assert outs[2].outputs[0].finish_reason == "stop"
        assert outs[2].outputs[0].token_ids[-1] == stop_id
        for out, ref in zip(outs[:2], base):
            assert_same(out.prompt_logprobs, ref.prompt_logprobs)
    sync.shutdown()


def stream(llm: LLM, prompt, params: SamplingParams, kind: RequestOutputKind) -> list:
    engine = llm.llm_engine
    engine.add_request("stream", prompt, params, kind)
    updates = []
    while engine.has_unfinished_requests():
        updates += engine.step()
    return updates


def test_streaming_delta_concatenates_to_the_final_logprobs(llm):
    params = greedy(max_tokens=10, logprobs=2, prompt_logprobs=1)
    prompt = {"prompt_token_ids": LONG_PROMPT}
    [final] = llm.generate(prompt, params, use_tqdm=False)
    updates = stream(llm, prompt, params, RequestOutputKind.DELTA)
    assert len(updates) > 3
    logprobs = [e for u in updates for e in u.outputs[0].logprobs]
    assert logprobs == final.outputs[0].logprobs
    assert all(len(u.outputs[0].logprobs) == len(u.outputs[0].token_ids) for u in updates)
    # Prompt logprobs go out once, in the first update.
    assert updates[0].prompt_logprobs == final.prompt_logprobs
    assert all(u.prompt_logprobs is None for u in updates[1:])
    assert updates[-1].outputs[0].cumulative_logprob == pytest.approx(
        final.outputs[0].cumulative_logprob)
    updates = stream(llm, prompt, params, RequestOutputKind.CUMULATIVE)
    assert all(len(u.outputs[0].logprobs) == len(u.outputs[0].token_ids) for u in updates)
    assert all(u.prompt_logprobs == final.prompt_logprobs for u in updates)
    assert updates[-1].outputs[0].logprobs == final.outputs[0].logprobs


def test_n_samples_each_carry_their_logprobs(llm):
    params = SamplingParams(n=2, seed=5, temperature=1.0, logprobs=2, prompt_logprobs=1,
                            max_tokens=8, ignore_eos=True)
    [out] = llm.generate(TEXT_PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    for i, completion in enumerate(out.outputs):
        [single] = llm.generate(TEXT_PROMPT, params.clone(n=1, seed=5 + i), use_tqdm=False)
        assert completion.token_ids == single.outputs[0].token_ids
        assert_same(completion.logprobs, single.outputs[0].logprobs)
        assert len(completion.logprobs) == len(completion.token_ids)
        assert_same(out.prompt_logprobs, single.prompt_logprobs)
    updates = stream(llm, TEXT_PROMPT, params, RequestOutputKind.DELTA)
    assert sum(u.prompt_logprobs is not None for u in updates) == 1
    for i, completion in enumerate(out.outputs):
        parts = [c for u in updates for c in u.outputs if c.index == i]
        assert [e for c in parts for e in c.logprobs] == completion.logprobs


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_stop_string_keeps_logprobs_aligned_with_token_ids(llm, kind):
    [full] = llm.generate(TEXT_PROMPT, greedy(max_tokens=40, logprobs=1), use_tqdm=False)
    text = full.outputs[0].text
    start = next(i for i in range(len(text) // 2, len(text) - 3)
                 if text.find(text[i:i + 3]) == i and "\ufffd" not in text[:i + 3])
    params = greedy(max_tokens=40, logprobs=1, stop=[text[start:start + 3]])
    updates = stream(llm, TEXT_PROMPT, params, kind)
    token_ids = [t for u in updates for t in u.outputs[0].token_ids]
    logprobs = [e for u in updates for e in u.outputs[0].logprobs]
    assert updates[-1].outputs[0].finish_reason == "stop"
    n = len(token_ids)
    assert len(logprobs) == n < len(full.outputs[0].token_ids)
    assert logprobs == full.outputs[0].logprobs[:n]


def test_processed_logprobs_are_the_tempered_distribution(tiny_llama, llm, hf_log_softmax):
    processed = LLM(str(tiny_llama), max_model_len=256, logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=0.7, seed=21, logprobs=3, max_tokens=8,
                            ignore_eos=True)
    tokenizer = processed.get_tokenizer()
    [out] = processed.generate(TEXT_PROMPT, params, use_tqdm=False)
    [raw] = llm.generate(TEXT_PROMPT, params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == raw.outputs[0].token_ids  # the mode changes no token
    seq = out.prompt_token_ids + completion.token_ids
    tempered, plain = hf_log_softmax(seq, 0.7), hf_log_softmax(seq)
    start = len(out.prompt_token_ids) - 1
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        check_entry(entry, tempered[start + i], token, 3, tokenizer)
        check_entry(raw.outputs[0].logprobs[i], plain[start + i], token, 3, tokenizer)
        assert abs(entry[token].logprob - plain[start + i, token].item()) > 1e-3
    processed.shutdown()


def test_bad_logprobs_mode_lists_the_allowed_values(tiny_llama):
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_llama), logprobs_mode="softmax")
    assert all(w in str(info.value) for w in ("softmax", "raw_logprobs", "processed_logprobs"))


def test_logprobs_cross_process_boundaries(llm, tiny_llama):
    """A core process (EngineCoreOutputs over ZMQ) driving a worker process (ModelRunnerOutput
    over shared memory): msgspec carries every logprobs field, nothing is pickled."""
    params = SamplingParams(temperature=0.8, seed=2, logprobs=3, prompt_logprobs=2,
                            max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": LONG_PROMPT}, TEXT_PROMPT]
    want = llm.generate(prompts, params, use_tqdm=False)
    remote = LLM(str(tiny_llama), max_model_len=256, max_num_batched_tokens=MAX_BATCHED,
                 multiprocess_core=True, distributed_executor_backend="mp")
    try:
        got = remote.generate(prompts, params, use_tqdm=False)
    finally:
        remote.shutdown()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert_same(g.outputs[0].logprobs, w.outputs[0].logprobs)
        assert_same(g.prompt_logprobs, w.prompt_logprobs)


def test_preemption_keeps_logprobs_whole(llm, tiny_llama):
    """A KV pool too small for the batch: requests are preempted (some mid-prefill, whose
    prompt rows are recomputed and not repeated) and resumed; every list stays whole."""
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block * kv heads * head dim * fp32
    small = LLM(str(tiny_llama), max_model_len=256, max_num_batched_tokens=MAX_BATCHED,
                kv_cache_memory_gb=24 * block_bytes / (1 << 30))
    gen = random.Random(7)
    prompts = [{"prompt_token_ids": [gen.randrange(3, 2000) for _ in range(gen.randrange(40, 120))]}
               for _ in range(6)]
    params = greedy(max_tokens=40, logprobs=2, prompt_logprobs=2)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    small.shutdown()
    for g, w in zip(got, llm.generate(prompts, params, use_tqdm=False)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.prompt_logprobs) == len(g.prompt_token_ids)
        assert_same(g.outputs[0].logprobs, w.outputs[0].logprobs)
        assert_same(g.prompt_logprobs, w.prompt_logprobs)
