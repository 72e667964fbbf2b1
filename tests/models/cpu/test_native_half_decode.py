"""A bfloat16 model's decode steps between oneDNN linears against the layer path: the same
tokens and logprobs bit for bit through the engine, taken only for the rows it runs, and only
for bias-free bfloat16 projections on a CPU that multiplies bfloat16 natively."""

from __future__ import annotations

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.cpu import native_half_decode
from mrv2.models.cpu.native_half_decode import MAX_NATIVE_DECODE_ROWS, NativeHalfDecode
from mrv2.models.layers import quantized

native = pytest.mark.skipif(not quantized.computes_natively(torch.bfloat16),
                            reason="this CPU has no bfloat16 matrix units (or no oneDNN)")


def _generate(llm: LLM, prompts, use_native: bool, monkeypatch) -> tuple[list, int]:
    calls = {"n": 0}
    real = NativeHalfDecode.__call__

    def counted(self, *args):
        calls["n"] += 1
        return real(self, *args)

    with monkeypatch.context() as m:
        m.setattr(NativeHalfDecode, "__call__", counted)
        if not use_native:
            m.setattr(NativeHalfDecode, "runs", staticmethod(lambda rows: False))
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, calls["n"]


@native
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_same_tokens_and_logprobs_as_the_layer_path(tiny_llama, kv_cache_dtype, monkeypatch):
    llm = LLM(str(tiny_llama), dtype="bfloat16", max_model_len=128, max_num_seqs=16,
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))}
               for i in range(quantized.MIN_NATIVE_HALF_ROWS + 3)]
    fast, fast_calls = _generate(llm, prompts, True, monkeypatch)
    plain, plain_calls = _generate(llm, prompts, False, monkeypatch)
    assert fast_calls > 0 and plain_calls == 0
    for a, b in zip(fast, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: p.logprob for t, p in la.items()} == {t: p.logprob for t, p in lb.items()}
    llm.shutdown()


@native
def test_fewer_rows_than_the_matrix_units_take_stay_off(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), dtype="bfloat16", max_model_len=128, max_num_seqs=16,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + i))}
               for i in range(quantized.MIN_NATIVE_HALF_ROWS - 1)]
    _, calls = _generate(llm, prompts, True, monkeypatch)
    assert calls == 0
    llm.shutdown()


def test_runs_from_the_matrix_units_rows_to_its_maximum():
    assert not NativeHalfDecode.runs(quantized.MIN_NATIVE_HALF_ROWS - 1)
    assert NativeHalfDecode.runs(quantized.MIN_NATIVE_HALF_ROWS)
    assert NativeHalfDecode.runs(MAX_NATIVE_DECODE_ROWS)
    assert not NativeHalfDecode.runs(MAX_NATIVE_DECODE_ROWS + 1)


@pytest.mark.parametrize("dtype, natively, attached", [
    ("bfloat16", True, True), ("bfloat16", False, False), ("float16", True, False),
    ("float32", True, False)])
def test_only_bfloat16_projections_on_a_native_cpu(tiny_llama, monkeypatch, dtype, natively,
                                                   attached):
    from mrv2.engine.arg_utils import EngineArgs
    from mrv2.models import cpu, load_model

    monkeypatch.setattr(quantized, "computes_natively", lambda d: natively)
    config = EngineArgs(model=str(tiny_llama), dtype=dtype,
                        device="cpu").create_engine_config().model_config
    model = load_model(config, torch.device("cpu"))
    cpu.attach(model, config)
    inner = model.model
    assert (native_half_decode.native_half_decode(inner) is not None) == attached
