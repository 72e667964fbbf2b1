"""LLM.embed / encode / score on a pooling engine (runner="pooling") against transformers: the
base model's hidden states after the final norm, of the last prompt token (LAST) or their mean
over the prompt (MEAN), normalised per the pooler config or the request. Prompts of many
lengths run mixed in one batch, in small prefill chunks, through the prefix cache (LAST) and
through preemption (MEAN)."""

from __future__ import annotations

import random

import pytest
import torch

from mrv2 import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams

PROMPT_LENS = [1, 2, 5, 15, 16, 17, 33, 40]
# One 16-token block of this tiny model's KV cache (2 layers, K and V, 2 heads of 16, fp32).
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_hidden(tiny_llama, prompts) -> list[torch.Tensor]:
    """transformers' final-norm hidden states of each prompt, [len, hidden]."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


@pytest.fixture(scope="module")
def last_llm(tiny_llama):
    llm = LLM(str(tiny_llama), runner="pooling", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=16, kv_cache_memory_gb=64 * BLOCK_BYTES / (1 << 30))
    yield llm
    llm.shutdown()


def close(got, want, atol: float = 2e-5) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32), want, atol=atol,
                               rtol=1e-4)


def test_last_pooling_matches_transformers_in_chunks_and_from_the_prefix_cache(
        last_llm, prompts, hf_hidden):
    assert last_llm.llm_engine.config.cache_config.enable_prefix_caching
    outputs = last_llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outputs)
    for prompt, output, hidden in zip(prompts, outputs, hf_hidden):
        assert output.prompt_token_ids == prompt
        assert output.outputs.hidden_size == hidden.shape[1]
        close(output.outputs.embedding, torch.nn.functional.normalize(hidden[-1], dim=0))
    # The longest prompt again: its first two blocks come from the prefix cache.
    again = last_llm.embed({"prompt_token_ids": prompts[-1]}, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    close(again.outputs.embedding, torch.tensor(outputs[-1].outputs.embedding), atol=1e-5)


def test_encode_score_and_per_request_params(last_llm, prompts, hf_hidden):
    raw = last_llm.encode([{"prompt_token_ids": p} for p in prompts[2:5]],
                          PoolingParams(normalize=False), use_tqdm=False)
    for output, hidden in zip(raw, hf_hidden[2:5]):
        assert output.outputs.data.dtype == torch.float32
        close(output.outputs.data, hidden[-1])
    truncated = last_llm.embed({"prompt_token_ids": prompts[-1]}, truncate_prompt_tokens=5,
                               use_tqdm=False)[0]
    assert truncated.prompt_token_ids == prompts[-1][-5:]
    text = last_llm.embed("hello world", use_tqdm=False)[0]
    assert text.prompt_token_ids == list(last_llm.get_tokenizer()("hello world").input_ids)

    first, others = {"prompt_token_ids": prompts[3]}, [{"prompt_token_ids": p}
                                                        for p in prompts[4:7]]
    scores = last_llm.score(first, others, use_tqdm=False)
    want = [torch.nn.functional.cosine_similarity(hf_hidden[3][-1], h[-1], dim=0)
            for h in hf_hidden[4:7]]
    assert [round(s.outputs.score, 5) for s in scores] == [round(float(w), 5) for w in want]
    pad = last_llm.get_tokenizer().pad_token_id
    assert scores[0].prompt_token_ids == prompts[3] + [pad] + prompts[4]
    pairwise = last_llm.score(others, others, use_tqdm=False)
    assert [s.outputs.score for s in pairwise] == pytest.approx([1.0] * 3, abs=1e-5)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        last_llm.score(others[:2], others, use_tqdm=False)


def test_a_pooling_engine_refuses_generation_and_unservable_params(last_llm):
    hidden = last_llm.llm_engine.config.model_config.hidden_size
    assert len(last_llm.embed("hi", PoolingParams(dimensions=hidden),
                              use_tqdm=False)[0].outputs.embedding) == hidden
    with pytest.raises(ValueError, match="dimensions=3 .*matryoshka"):
        last_llm.embed("hi", PoolingParams(dimensions=3), use_tqdm=False)
    with pytest.raises(ValueError, match="runner='generate'"):
        last_llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="runner='generate'"):
        last_llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="'token_embed'"):
        last_llm.encode("hi", pooling_task="token_embed", use_tqdm=False)
    assert last_llm.embed("still serving", use_tqdm=False)[0].finished


def test_mean_pooling_matches_transformers_under_preemption(tiny_llama, prompts, hf_hidden):
    # 4 usable blocks for 8 prompts that need 15 together: the scheduler preempts and
    # re-adds a request mid-prefill; a re-added request's sum starts over. (Async scheduling:
    # its step in flight holds the blocks that make the next step preempt.)
    llm = LLM(str(tiny_llama), runner="pooling", max_model_len=48, max_num_seqs=8,
              async_scheduling=True,
              max_num_batched_tokens=16, kv_cache_memory_gb=5 * BLOCK_BYTES / (1 << 30),
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    try:
        assert not llm.llm_engine.config.cache_config.enable_prefix_caching
        params = [PoolingParams(normalize=i % 2 == 1) for i in range(len(prompts))]
        outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], params,
                             use_tqdm=False)
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        for i, (output, hidden) in enumerate(zip(outputs, hf_hidden)):
            want = hidden.mean(0)
            close(output.outputs.data, torch.nn.functional.normalize(want, dim=0)
                  if i % 2 else want)
    finally:
        llm.shutdown()


def test_a_generate_engine_refuses_pooling(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64, max_num_seqs=2)
    try:
        for call in (lambda: llm.embed("hi", use_tqdm=False),
                     lambda: llm.encode("hi", use_tqdm=False),
                     lambda: llm.score("a", "b", use_tqdm=False)):
            with pytest.raises(ValueError, match="runner='pooling'"):
                call()
        assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    finally:
        llm.shutdown()


def test_a_prompt_over_the_context_says_how_to_truncate(last_llm):
    long = {"prompt_token_ids": [5] * 128}
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        last_llm.embed(long, use_tqdm=False)
    kept = last_llm.embed(long, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(kept.prompt_token_ids) == 127
