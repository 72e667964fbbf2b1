"""mrv2's reduced-precision paths stay within the first-order logprob bound of
mrv2/testing/logprob_bound.py, on a tiny Llama written as a Q4_1 GGUF: every prompt logprob
(prefill) and every sampled token's logprob (decode) of a greedy run, against the float64 model
of the file's dequantized weights."""

from __future__ import annotations

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.layers import linear_plan, quantized_numba
from mrv2.models.layers.quantized_int8_numba import X86_INT8_DOTS
from mrv2.testing.logprob_bound import (BFLOAT16_UNIT_ROUNDOFF, FLOAT16_UNIT_ROUNDOFF, Rounding,
                                        gamma, logprob_bounds)

PROMPT = [5, 17, 300, 42, 9, 1000, 3, 3, 77, 12, 400, 8, 1500, 250, 6, 91]
NEW_TOKENS = 8
BLOCKS = Rounding(weights_in_blocks=True)


@pytest.fixture(scope="module")
def q4_1_file(tiny_gguf_factory):
    return tiny_gguf_factory("llama", "Q4_1", num_layers=3, intermediate_size=192)


@pytest.fixture(scope="module")
def exact_model(q4_1_file):
    """transformers' reading of the file (its weights dequantized): config and state dict."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(q4_1_file.parent, gguf_file=q4_1_file.name,
                                              dtype=torch.float32)
    return hf.config, hf.state_dict()


def _run(path, **kwargs) -> tuple[list[int], list[tuple[int, int]], list[float], LLM]:
    """mrv2's greedy run: the whole sequence, the (position, token) targets and their
    logprobs (prompt logprobs, then the sampled tokens')."""
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_gb=0.02, **kwargs)
    try:
        out = llm.generate({"prompt_token_ids": PROMPT},
                           SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                          logprobs=0, prompt_logprobs=0), use_tqdm=False)[0]
        config = llm.llm_engine.engine_core.config.model_config
    finally:
        llm.shutdown()
    completion = out.outputs[0]
    sequence = PROMPT + list(completion.token_ids)
    targets, logprobs = [], []
    steps = list(out.prompt_logprobs[1:]) + list(completion.logprobs)
    for position, step in enumerate(steps):
        token = sequence[position + 1]
        targets.append((position, token))
        logprobs.append(step[token].logprob)
    return sequence, targets, logprobs, config


def _check(exact_model, path, rounding: Rounding, **kwargs) -> float:
    sequence, targets, logprobs, _ = _run(path, **kwargs)
    exact, (bounds,) = logprob_bounds(*exact_model, sequence[:-1], targets, (rounding,))
    bound = bounds.bound
    error = (torch.tensor(logprobs, dtype=torch.float64) - exact).abs()
    worst = int((error / bound).argmax())
    assert bool((error <= bound).all()), (
        f"target {targets[worst]}: |error| {error[worst]:.3g} > bound {bound[worst]:.3g}")
    return float((error / bound).max())


def test_blocks_with_float32_activations(exact_model, q4_1_file, float_activations):
    _check(exact_model, q4_1_file, BLOCKS, quantization="gguf")


def test_float32_weights_dequantized_at_load(exact_model, q4_1_file):
    _check(exact_model, q4_1_file, BLOCKS, dtype="float32")


@pytest.mark.skipif(not X86_INT8_DOTS, reason="integer x needs x86 AVX2")
@pytest.mark.parametrize("x_format, levels", [(quantized_numba.X_INT8, 127),
                                              (quantized_numba.X_INT16, 32767)])
def test_integer_activations(exact_model, q4_1_file, monkeypatch, x_format, levels):
    monkeypatch.setattr(linear_plan, "GEMV_X_FORMAT", x_format)  # the LLM's weights' plans
    ratio = _check(exact_model, q4_1_file,
                   Rounding(activation_levels=levels, weights_in_blocks=True), quantization="gguf")
    if levels == 127:
        assert ratio > 1e-3  # the bound is not vacuous: the int8 rounding shows in the logprobs


@pytest.mark.parametrize("dtype, unit_roundoff", [("bfloat16", BFLOAT16_UNIT_ROUNDOFF),
                                                  ("float16", FLOAT16_UNIT_ROUNDOFF)])
def test_16_bit_weights(exact_model, q4_1_file, dtype, unit_roundoff):
    sequence, targets, logprobs, config = _run(q4_1_file, dtype=dtype)
    if config.cpu_weight_dtype is None:
        pytest.skip(f"this CPU computes in {dtype} (the bound covers 16-bit weights with "
                    "float32 compute)")
    rounding = Rounding(weight_unit_roundoff=unit_roundoff, weights_in_blocks=True)
    ratio = _check(exact_model, q4_1_file, rounding, dtype=dtype)
    assert ratio > 1e-3


def test_16_bit_kv_cache(exact_model, q4_1_file, float_activations):
    ratio = _check(exact_model, q4_1_file,
                   Rounding(kv_unit_roundoff=BFLOAT16_UNIT_ROUNDOFF, weights_in_blocks=True),
                   quantization="gguf", kv_cache_dtype="bfloat16")
    assert ratio > 1e-3


def test_the_bound_grows_with_the_rounding(exact_model):
    config, state = exact_model
    targets = [(len(PROMPT) - 1, 7), (3, 300)]
    exact, (base, wider) = logprob_bounds(
        config, state, PROMPT, targets,
        (BLOCKS, Rounding(weight_unit_roundoff=BFLOAT16_UNIT_ROUNDOFF, weights_in_blocks=True)))
    assert bool((wider.bound > 30 * base.bound).all())
    assert bool((wider.rms < wider.bound).all())
    # the float64 model itself: transformers' float32 logprobs are within float32's bound
    with torch.no_grad():
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        hf.load_state_dict(state)
        hf_logprobs = hf(torch.tensor([PROMPT])).logits[0].double().log_softmax(-1)
    for (position, token), value, bound in zip(targets, exact, base.bound):
        assert abs(float(hf_logprobs[position, token]) - float(value)) <= float(bound)


def test_gamma_is_the_sum_bound():
    assert gamma(1) == pytest.approx(2.0 ** -24)
    assert gamma(1000) > 1000 * 2.0 ** -24
