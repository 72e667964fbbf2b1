"""Decode of the built-in SmolLM2-135M in bfloat16 on a CPU with bfloat16 matrix units, batches
from the rows where the linears move to oneDNN: the layers between oneDNN calls
(mrv2/models/cpu/native_half_decode.py) against the layer path (the same model with that path
turned off), in the same run.

128-token prompts (token ids, not text: every row the same length), greedy, 64 tokens, EOS
ignored, prefix caching off, 2 threads; one LLM serves every case. extra_info
`decode_tokens_per_s` as bench/test_quantized_decode.py computes it (gguf_workload.py).
Skipped where the CPU has no bfloat16 matrix units: there the path never runs.

Under `--benchmark-disable` (CI) each case runs once, 16-token prompts and 4 tokens out, and
checks which path ran.
"""

from __future__ import annotations


import pytest
import torch

from gguf_workload import decode_tokens_per_s, gguf_path, greedy_timer, token_id_prompts
from mrv2.models.layers import quantized

ROUNDS = 5
OUTPUT_LEN = 64
PROMPT_LEN = 128
_LLM: list = []

pytestmark = [
    pytest.mark.usefixtures("two_threads"),  # bench/conftest.py
    pytest.mark.skipif(not quantized.computes_natively(torch.bfloat16),
                       reason="this CPU has no bfloat16 matrix units (or no oneDNN)"),
]


def _llm():
    from mrv2 import LLM

    if not _LLM:
        _LLM.append(LLM(str(gguf_path()), dtype="bfloat16", max_model_len=256,
                        max_num_seqs=32, enable_prefix_caching=False))
    return _LLM[0]


@pytest.fixture(scope="module", autouse=True)
def _shutdown():
    yield
    for llm in _LLM:
        llm.shutdown()
    _LLM.clear()


@pytest.mark.parametrize("path", ["native", "layers"])
@pytest.mark.parametrize("batch", [8, 32])
def test_native_half_decode(benchmark, monkeypatch, batch, path):
    from mrv2.models.cpu.native_half_decode import NativeHalfDecode

    llm = _llm()
    calls = {"n": 0}
    real = NativeHalfDecode.__call__

    def counted(self, *args):
        calls["n"] += 1
        return real(self, *args)

    monkeypatch.setattr(NativeHalfDecode, "__call__", counted)
    if path == "layers":
        monkeypatch.setattr(NativeHalfDecode, "runs", staticmethod(lambda rows: False))
    prompt_len = 16 if benchmark.disabled else PROMPT_LEN
    prompts = token_id_prompts(batch, prompt_len)
    tokens = 4 if benchmark.disabled else OUTPUT_LEN

    generate = greedy_timer(llm, prompts)

    benchmark.group = f"native-half-decode-b{batch}"
    if benchmark.disabled:
        benchmark(generate, tokens)
        assert (calls["n"] > 0) is (path == "native")
        return
    generate(8)  # warm-up
    rate = decode_tokens_per_s(benchmark, generate, tokens, batch, ROUNDS)
    benchmark.extra_info.update(path=path, batch=batch, output_len=tokens, threads=2,
                                decode_tokens_per_s=rate)
