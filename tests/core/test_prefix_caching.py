"""End to end: prefix-cache hits leave greedy outputs unchanged (vs caching off, vs transformers).

The real model and the real paged attention read the reused blocks, so a hit that points at
the wrong KV, or a shared block that gets overwritten, shows up as a different token.
"""

from __future__ import annotations

import random

import pytest
import torch

from mrv2 import LLM, SamplingParams

BLOCK_SIZE = 16
PREFIX_LEN = 100
SUFFIX_LENS = [1, 7, 12, 29, 44]
MAX_TOKENS = 16


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def case(tiny_llama):
    """Prompts sharing a 100-token prefix, the first two of them twice; transformers' output."""
    rng = random.Random(4321)
    prefix = [rng.randrange(3, 2000) for _ in range(PREFIX_LEN)]
    distinct = [prefix + [rng.randrange(3, 2000) for _ in range(n)] for n in SUFFIX_LENS]
    expected = hf_greedy(tiny_llama, distinct, MAX_TOKENS)
    return distinct + distinct[:2], expected + expected[:2]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _max_hit(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # full blocks, never the last token


# None: one step admits every prompt, and the later ones hit blocks that the first computes in
# that very step. 48: prompts are prefilled in chunks over several steps.
@pytest.mark.parametrize("max_num_batched_tokens", [None, 48])
def test_prefix_cache_hits_keep_greedy_outputs_exact(tiny_llama, case, max_num_batched_tokens):
    prompts, expected = case
    kwargs = dict(max_model_len=256, block_size=BLOCK_SIZE,
                  max_num_batched_tokens=max_num_batched_tokens)
    llm = LLM(str(tiny_llama), enable_prefix_caching=True, **kwargs)
    scheduler = llm.llm_engine.engine_core.scheduler
    stats = scheduler.prefix_cache_stats
    assert _generate(llm, prompts) == expected
    # Within one batch: every prompt after the first reuses the shared prefix's full blocks
    # (the repeated prompts too: their next block is still partial when they are admitted).
    assert stats.requests == len(prompts)
    assert stats.queries == sum(len(p) for p in prompts)
    assert stats.hits == (len(prompts) - 1) * (PREFIX_LEN // BLOCK_SIZE * BLOCK_SIZE)

    # The same prompts again: every full block of every prompt is cached by now.
    stats.reset()
    assert _generate(llm, prompts) == expected
    assert stats.hits == sum(_max_hit(p) for p in prompts)
    assert scheduler.kv_cache_usage == 0.0  # all blocks free or cached-and-evictable

    off = LLM(str(tiny_llama), enable_prefix_caching=False, **kwargs)
    assert _generate(off, prompts) == expected
    off_stats = off.llm_engine.engine_core.scheduler.prefix_cache_stats
    assert (off_stats.requests, off_stats.hits) == (0, 0)


def test_prefix_caching_is_on_by_default(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=256)
    assert llm.llm_engine.config.cache_config.enable_prefix_caching
