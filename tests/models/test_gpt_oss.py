"""gpt-oss end to end (models/gpt_oss.py): on a tiny random checkpoint (GQA, sinks, a window
shorter than the prompts on every other layer, YaRN, 4 experts top-2 with biases and a SwiGLU
limit low enough to clamp), greedy tokens equal transformers' float32 ones and prompt
logprobs are within 1e-4 of its log-softmax, prefilled in chunks (a token budget smaller than
the prompt); under tensor parallelism 2 too."""

from __future__ import annotations

import random

import pytest
import torch

from mrv2 import LLM, SamplingParams
from tests.entrypoints.test_llm import hf_greedy

MAX_TOKENS = 6
TINY_GPT_OSS = dict(num_layers=2, rope_scaling={
    "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}, max_position_embeddings=128,
    config={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
            "swiglu_limit": 1.0, "layer_types": ["sliding_attention", "full_attention"]})
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 2000) for _ in range(n)] for n in (37, 5)]


@pytest.fixture(scope="module")
def gpt_oss_dir(tiny_model_factory):
    return tiny_model_factory("gpt_oss", **TINY_GPT_OSS)


@pytest.fixture(scope="module")
def expected(gpt_oss_dir) -> list[list[int]]:
    return hf_greedy(gpt_oss_dir, PROMPTS, MAX_TOKENS)


def _generate(model_dir, prompt_logprobs: int | None = None, **llm_kwargs) -> list:
    llm = LLM(str(model_dir), max_model_len=96, block_size=8, max_num_batched_tokens=16,
              **llm_kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                prompt_logprobs=prompt_logprobs)
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
    finally:
        llm.shutdown()


def test_greedy_and_prompt_logprobs_match_transformers(gpt_oss_dir, expected):
    from transformers import AutoModelForCausalLM

    outputs = _generate(gpt_oss_dir, prompt_logprobs=0)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    ref = AutoModelForCausalLM.from_pretrained(gpt_oss_dir, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outputs):
        with torch.inference_mode():
            rows = ref(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
        got = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:],
                                                             prompt[1:])]
        want = rows[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert max(abs(g - w) for g, w in zip(got, want.tolist())) < 1e-4


def test_tensor_parallel_2_matches_transformers(gpt_oss_dir, expected):
    """Each rank its heads (and their sinks) and every expert's half of the intermediate."""
    outputs = _generate(gpt_oss_dir, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in outputs] == expected
