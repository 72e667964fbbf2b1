"""The LM head inside the fused decode stack: each stack step's logits reach the sampler (the
runner's ExecuteState.logits, in place of `compute_logits`) and equal the model's own
`compute_logits` on the same rows; none for steps beyond the head's GEMV rows; the head the
stack takes (`lm_head`), and no fused path for a model that declares no spec the stack
supports."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.cpu import decode as cpu_decode
from mrv2.models.cpu import decode_logits
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.cpu_gemv import MAX_GEMV_ROWS
from mrv2.sampler import Sampler


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.runner


def _generate(llm: LLM, prompts, fused: bool, monkeypatch) -> tuple[list, dict[str, int]]:
    """(outputs, counts): "stack" steps of the stack; "logits" of them whose logits the
    sampler was handed (the very tensor, checked against the model's `compute_logits` on the
    stack's hidden states); "computed" of them the sampler got `compute_logits`' logits for."""
    runner = _runner(llm)
    counts = {"stack": 0, "logits": 0, "computed": 0}
    step: dict[str, tuple] = {}  # the last stack step's (hidden, logits), until sampled
    real_decode, real_sample = cpu_decode.decode_model, Sampler.__call__

    def counted(*args):
        out = real_decode(*args)
        counts["stack"] += 1
        step["out"] = out
        return out

    def sample(self, logits, *args):
        if "out" in step:  # execute_model and sample_tokens alternate: this step's
            hidden, stack_logits = step.pop("out")
            own = runner.model.compute_logits(hidden)
            if stack_logits is None:
                counts["computed"] += 1
                assert torch.equal(logits, own)
            else:
                counts["logits"] += 1
                assert logits is stack_logits
                # The same kernel; compiled into the stack, LLVM may order a float32 sum
                # differently.
                torch.testing.assert_close(logits, own, rtol=0, atol=1e-5)
        return real_sample(self, logits, *args)

    with monkeypatch.context() as m:
        m.setattr(cpu_decode, "decode_model", counted)
        m.setattr(Sampler, "__call__", sample)
        if not fused:
            m.setattr(cpu_decode, "applies", lambda *args: False)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, counts


def _prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": list(range(5 + i, 25 + 3 * i))} for i in range(n)]


def _same_tokens(a, b) -> bool:
    return [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_float32_head_in_every_stack_step(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), max_model_len=128, enable_prefix_caching=False)
    assert _runner(llm).fused_decode.head.max_rows == cpu_decode.MAX_DECODE_ROWS
    fused, counts = _generate(llm, _prompts(3), True, monkeypatch)
    plain, plain_counts = _generate(llm, _prompts(3), False, monkeypatch)
    llm.shutdown()
    assert counts["stack"] > 0 and counts["logits"] == counts["stack"]
    assert plain_counts == {"stack": 0, "logits": 0, "computed": 0}
    assert _same_tokens(fused, plain)


# Float activations: x rounded to int16/int8 makes a GEMV's output a step function of x; the
# head sees the stack's own output either way, but keep the layers' paths comparable.
@pytest.mark.usefixtures("float_activations")
@pytest.mark.parametrize("tensor_type, tied", [("Q8_0", False), ("Q4_1", True), ("BF16", False)])
def test_gguf_head_in_every_stack_step(tiny_gguf_factory, tensor_type, tied, monkeypatch):
    """Blocks (untied and tied to the embedding) and 16-bit heads."""
    llm = LLM(str(tiny_gguf_factory("llama", tensor_type, tie_word_embeddings=tied)),
              max_model_len=128, max_num_seqs=4, enable_prefix_caching=False,
              quantization="gguf")
    fused = _runner(llm).fused_decode
    model = _runner(llm).model
    head = model.model.embed_tokens if tied else model.lm_head
    assert fused.head.weight is head.packed  # the weight `compute_logits` multiplies by
    rows = min(2, fused.head.max_rows)
    out, counts = _generate(llm, _prompts(rows), True, monkeypatch)
    plain, _ = _generate(llm, _prompts(rows), False, monkeypatch)
    llm.shutdown()
    assert counts["stack"] > 0 and counts["logits"] == counts["stack"]
    assert _same_tokens(out, plain)


@pytest.mark.usefixtures("float_activations")
def test_steps_beyond_the_heads_gemv_rows_take_compute_logits(tiny_gguf_factory, monkeypatch):
    """A head whose `compute_logits` leaves the GEMV at fewer rows than the stack runs (a
    16-bit head on matrix units beside quantized layers): the stack computes no logits for
    those steps, and the sampler's come from `compute_logits` itself."""
    llm = LLM(str(tiny_gguf_factory("llama", "Q8_0")), max_model_len=128, max_num_seqs=8,
              enable_prefix_caching=False, quantization="gguf")
    fused = _runner(llm).fused_decode
    assert fused.head.max_rows == cpu_decode.MAX_QUANTIZED_DECODE_ROWS
    fused.head, fused.args = dataclasses.replace(fused.head, max_rows=2), None
    wide, wide_counts = _generate(llm, _prompts(3), True, monkeypatch)
    narrow, narrow_counts = _generate(llm, _prompts(2), True, monkeypatch)
    plain, _ = _generate(llm, _prompts(3), False, monkeypatch)
    llm.shutdown()
    assert wide_counts["stack"] > 0 and wide_counts["logits"] == 0
    assert wide_counts["computed"] == wide_counts["stack"]
    assert narrow_counts["stack"] > 0 and narrow_counts["logits"] == narrow_counts["stack"]
    assert _same_tokens(wide, plain) and _same_tokens(narrow, plain[:2])


def test_the_sampler_samples_the_stacks_logits_not_compute_logits(tiny_llama, monkeypatch):
    """A stack step's logits are what its tokens are sampled from: logits that favour one
    token, returned by the fused path, give that token at every decode step, and
    `compute_logits` is called only for the prefill."""
    llm = LLM(str(tiny_llama), max_model_len=64, enable_prefix_caching=False,
              num_scheduler_steps=1)  # each decode step its own forward, no run of steps
    runner = _runner(llm)
    fused, model = runner.fused_decode, runner.model
    real_forward, real_logits = fused.forward, type(model).compute_logits
    calls = {"stack": 0, "compute_logits": 0}

    def marked(*args):
        stepped = real_forward(*args)
        if stepped is not None and stepped[1] is not None:
            calls["stack"] += 1
            favoured = torch.full_like(stepped[1], -1e4)
            favoured[:, 7] = 0.0
            return stepped[0], favoured
        return stepped

    def counted(self, hidden_states):
        calls["compute_logits"] += 1
        return real_logits(self, hidden_states)

    monkeypatch.setattr(fused, "forward", marked)
    monkeypatch.setattr(type(model), "compute_logits", counted)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.generate(_prompts(2), params, use_tqdm=False)
    llm.shutdown()
    assert calls["stack"] == 4 and calls["compute_logits"] == 1  # one prefill, 4 decodes
    assert all(o.outputs[0].token_ids[1:] == [7] * 4 for o in out)


def test_the_head_the_stack_takes(tiny_llama):
    """A float32 head on one rank, as the GEMV's rows; a packed head's weight (the GGUF tests
    above); none for a head of another dtype or split over ranks."""
    llm = LLM(str(tiny_llama), max_model_len=64)
    model = _runner(llm).model
    llm.shutdown()
    head = decode_logits.lm_head(model)
    assert head.weight is model.lm_head.weight and head.max_rows == MAX_GEMV_ROWS
    weight = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(weight.detach().bfloat16(), requires_grad=False)
    assert decode_logits.lm_head(model) is None
    model.lm_head.weight = weight
    model.lm_head.tp_size = 2
    assert decode_logits.lm_head(model) is None


def test_no_fused_path_without_a_supported_decoder_spec(tiny_llama):
    """The spec is the contract: a model that declares none (or one the stack does not
    compute) runs every step itself."""
    assert not cpu_decode.supports(None)
    llm = LLM(str(tiny_llama), max_model_len=64)
    model = _runner(llm).model
    llm.shutdown()
    assert cpu_decode.supports(model.decoder_spec)
    assert cpu_decode.fused_decode(model) is not None
    model.decoder_spec = DecoderSpec(qkv_bias=False, o_bias=False, qk_norm=False,
                                     mlp_bias=False, activation="gelu")
    assert not cpu_decode.supports(model.decoder_spec)
    assert cpu_decode.fused_decode(model) is None
    del model.decoder_spec
    assert cpu_decode.fused_decode(model) is None
