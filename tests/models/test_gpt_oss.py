"""gpt-oss end to end (models/gpt_oss.py): on a tiny random checkpoint (GQA, sinks, a window
shorter than the prompts on every other layer, YaRN, 4 experts top-2 with biases and a SwiGLU
limit low enough to clamp), greedy tokens equal transformers' float32 ones and prompt
logprobs are within 1e-4 of its log-softmax, prefilled in chunks (a token budget smaller than
the prompt. With llama.cpp's SwiGLU limit (a GGUF file cannot hold another), its MXFP4 form
(the experts quantized as the released checkpoints store them: tests/models/mxfp4_helpers.py)
gives the tokens transformers gives on the dequantized weights: computed on the blocks as
stored (CPU, one rank), dequantized under tensor parallelism 2 (each rank its heads and
sinks, every expert's half of the intermediate), and from GGUF files written as llama.cpp's
converter writes them (an F32 one of the dequantized weights; the MXFP4 experts' one,
computed on its blocks under quantization="gguf")."""

from __future__ import annotations

import random

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing.gguf_writer import write_gguf
from tests.entrypoints.test_llm import hf_greedy
from tests.models.mxfp4_helpers import mxfp4_checkpoints

MAX_TOKENS = 6
TINY_GPT_OSS = dict(num_layers=2, rope_scaling={
    "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}, max_position_embeddings=128,
    config={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
            "swiglu_limit": 1.0, "layer_types": ["sliding_attention", "full_attention"]})
_rng = random.Random(5)
# The MXFP4 and GGUF forms' source: llama.cpp's (the config's default) SwiGLU limit.
TINY_GPT_OSS_7 = {**TINY_GPT_OSS, "config": {**TINY_GPT_OSS["config"], "swiglu_limit": 7.0}}
PROMPTS = [[_rng.randrange(3, 2000) for _ in range(n)] for n in (37, 5)]


@pytest.fixture(scope="module")
def gpt_oss_dir(tiny_model_factory):
    return tiny_model_factory("gpt_oss", **TINY_GPT_OSS)


@pytest.fixture(scope="module")
def expected(gpt_oss_dir) -> list[list[int]]:
    return hf_greedy(gpt_oss_dir, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def mxfp4_dirs(tiny_model_factory, tmp_path_factory):
    """(the MXFP4 checkpoint, its dequantized float twin, transformers' tokens on the twin)."""
    quantized, twin = mxfp4_checkpoints(tiny_model_factory("gpt_oss", **TINY_GPT_OSS_7),
                                        tmp_path_factory.mktemp("gpt-oss"))
    return quantized, twin, hf_greedy(twin, PROMPTS, MAX_TOKENS)


def _generate(model_dir, prompt_logprobs: int | None = None, check=None, **llm_kwargs) -> list:
    """The prompts' outputs; `check(model)` on the loaded model first (in process only)."""
    llm = LLM(str(model_dir), max_model_len=96, block_size=8, max_num_batched_tokens=16,
              **llm_kwargs)
    try:
        if check is not None:
            check(llm.llm_engine.engine_core.executor.worker.model)
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


def _experts_on_mxfp4_blocks(model) -> None:
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert experts.gate_up_proj.numel() == 0 and len(experts.packed) == 4
        assert all(w.gguf_type == "MXFP4" for pair in experts.packed for w in pair)


@pytest.mark.usefixtures("float_activations")  # x stays float32 in the GEMVs on the blocks
def test_mxfp4_experts_on_their_blocks_match_transformers(mxfp4_dirs):
    quantized, _, expected = mxfp4_dirs
    outputs = _generate(quantized, check=_experts_on_mxfp4_blocks)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_mxfp4_dequantized_under_tensor_parallel_2_matches_transformers(mxfp4_dirs):
    quantized, _, expected = mxfp4_dirs
    outputs = _generate(quantized, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.usefixtures("float_activations")
def test_gguf_files_match_transformers(mxfp4_dirs, tmp_path):
    """The F32 file (sinks, router and expert biases, the window, YaRN read back), and the
    MXFP4 experts' file computed on its blocks."""
    quantized, twin, expected = mxfp4_dirs
    (f32,) = write_gguf(twin, tmp_path / "f32" / "tiny.gguf", "F32")
    (mxfp4,) = write_gguf(quantized, tmp_path / "mxfp4" / "tiny.gguf", "F32")
    for path, kwargs in ((f32, {}), (mxfp4, {"quantization": "gguf",
                                             "check": _experts_on_mxfp4_blocks})):
        outputs = _generate(path, **kwargs)
        assert [o.outputs[0].token_ids for o in outputs] == expected
