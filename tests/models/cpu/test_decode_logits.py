"""The LM head inside the fused decode stack: each step's logits equal the head's own
`compute_logits` on the same rows, every decode step of the stack has them, none beyond the
head's GEMV rows, and `compute_logits` hands them out only for the hidden states they came
with."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.cpu import decode as cpu_decode
from mrv2.models.cpu import decode_logits


def _generate(llm: LLM, prompts, fused: bool, monkeypatch) -> tuple[list, int, int]:
    """(outputs, stack calls, steps whose logits the stack computed); each such step's
    logits are checked against the head's own `compute_logits` on the same hidden states."""
    calls = {"stack": 0, "logits": 0}
    real = cpu_decode.decode_model

    def counted(*args):
        calls["stack"] += 1
        return real(*args)

    def checked(self, hidden_states):
        logits = self.fused.take_logits(hidden_states)
        own = self.compute_logits(hidden_states)
        if logits is not None:
            calls["logits"] += 1
            # The same kernel; compiled into the stack, LLVM may order a float32 sum
            # differently.
            torch.testing.assert_close(logits, own, rtol=0, atol=1e-5)
        return own if logits is None else logits

    with monkeypatch.context() as m:
        m.setattr(cpu_decode, "decode_model", counted)
        m.setattr(decode_logits.StackLogits, "__call__", checked)
        if not fused:
            m.setattr(cpu_decode, "applies", lambda *args: False)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, calls["stack"], calls["logits"]


def _prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": list(range(5 + i, 25 + 3 * i))} for i in range(n)]


def _same_tokens(a, b) -> bool:
    return [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_float32_head_in_every_stack_step(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), max_model_len=128, enable_prefix_caching=False)
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    assert isinstance(model.compute_logits, decode_logits.StackLogits)
    assert model.model.forward.head.max_rows == cpu_decode.MAX_DECODE_ROWS
    fused, stack, logits = _generate(llm, _prompts(3), True, monkeypatch)
    plain, plain_stack, plain_logits = _generate(llm, _prompts(3), False, monkeypatch)
    llm.shutdown()
    assert stack > 0 and logits == stack
    assert plain_stack == plain_logits == 0
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
    head = llm.llm_engine.engine_core.executor.worker.runner.model.model.forward.head
    rows = min(2, head.max_rows)
    fused, stack, logits = _generate(llm, _prompts(rows), True, monkeypatch)
    plain, _, _ = _generate(llm, _prompts(rows), False, monkeypatch)
    llm.shutdown()
    assert stack > 0 and logits == stack
    assert _same_tokens(fused, plain)


@pytest.mark.usefixtures("float_activations")
def test_steps_beyond_the_heads_gemv_rows_take_compute_logits(tiny_gguf_factory, monkeypatch):
    """A head whose `compute_logits` leaves the GEMV at fewer rows than the stack runs (a
    16-bit head on matrix units beside quantized layers): the stack computes no logits for
    those steps, and the engine's come from `compute_logits` itself."""
    llm = LLM(str(tiny_gguf_factory("llama", "Q8_0")), max_model_len=128, max_num_seqs=8,
              enable_prefix_caching=False, quantization="gguf")
    fused = llm.llm_engine.engine_core.executor.worker.runner.model.model.forward
    assert fused.head.max_rows == cpu_decode.MAX_QUANTIZED_DECODE_ROWS
    fused.head, fused.args = dataclasses.replace(fused.head, max_rows=2), None
    wide, wide_stack, wide_logits = _generate(llm, _prompts(3), True, monkeypatch)
    narrow, narrow_stack, narrow_logits = _generate(llm, _prompts(2), True, monkeypatch)
    plain, _, _ = _generate(llm, _prompts(3), False, monkeypatch)
    llm.shutdown()
    assert wide_stack > 0 and wide_logits == 0
    assert narrow_stack > 0 and narrow_logits == narrow_stack
    assert _same_tokens(wide, plain) and _same_tokens(narrow, plain[:2])


def test_logits_go_once_to_the_tensor_they_came_with(tiny_llama):
    """`compute_logits` hands out a stack step's logits only for the very hidden states that
    step returned, and only once; equal values in another tensor are computed."""
    llm = LLM(str(tiny_llama), max_model_len=64)
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    llm.shutdown()
    fused = model.model.forward
    hidden = torch.randn(2, model.model.norm.weight.shape[0])
    own = model.compute_logits(hidden)
    marked = torch.full_like(own, 7.0)
    fused._logits = (hidden, marked)
    assert torch.equal(model.compute_logits(hidden.clone()), own)  # another tensor
    assert model.compute_logits(hidden) is marked
    assert torch.equal(model.compute_logits(hidden), own)  # taken already


def test_no_head_in_the_stack_where_logits_are_computed_otherwise(tiny_llama):
    """A model class with its own `compute_logits` (a softcap, a scale) keeps it whole."""
    llm = LLM(str(tiny_llama), max_model_len=64)
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    llm.shutdown()
    assert decode_logits.lm_head(model) is None  # compute_logits is a StackLogits now
    del model.compute_logits
    assert decode_logits.lm_head(model) is not None

    class Scaled(type(model)):
        def compute_logits(self, hidden_states):
            return super().compute_logits(hidden_states) * 0.5

    model.__class__ = Scaled
    assert decode_logits.lm_head(model) is None
