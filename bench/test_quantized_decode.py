"""Decode of the built-in SmolLM2-135M Q4_1 GGUF: `quantization="gguf"` (the fused decode stack
on the blocks), the same blocks layer by layer (the stack turned off), and the file dequantized
to float32 (its own fused stack up to MAX_DECODE_ROWS rows, oneDNN beyond).

Batch 1 and 8 of a short text prompt, greedy, 64 tokens, EOS ignored, prefix caching off, 2
threads; one LLM per weight kind serves every case of the module. Each timed round generates
64 tokens and then 1: extra_info `decode_tokens_per_s` = 63 * batch / (median 64-token seconds
- median 1-token seconds), the decode rate without the prefill. Cores shared with other work
disturb single rounds: compare kinds from one run (bench/README.md has the figures).

Under `--benchmark-disable` (CI) each case runs once with 4 tokens and checks that the
quantized stack ran (and that the unfused case did not).
"""

from __future__ import annotations

import pytest

from gguf_workload import decode_case, gguf_path, greedy_timer, shutdown_after_module

ROUNDS = 5
OUTPUT_LEN = 64
_LLMS: dict[str, object] = {}

pytestmark = pytest.mark.usefixtures("two_threads")  # bench/conftest.py


def _llm(quantized: bool):
    from mrv2 import LLM

    key = "gguf" if quantized else "float32"
    if key not in _LLMS:
        _LLMS[key] = LLM(str(gguf_path()), max_model_len=256, max_num_seqs=8,
                         enable_prefix_caching=False,
                         quantization="gguf" if quantized else None)
    return _LLMS[key]


_shutdown = shutdown_after_module(_LLMS)


@pytest.mark.parametrize("kind", ["gguf", "gguf_unfused", "float32"])
@pytest.mark.parametrize("batch", [1, 8])
def test_quantized_decode(benchmark, monkeypatch, batch, kind):
    from mrv2.models.cpu import decode as cpu_decode

    llm = _llm(kind != "float32")
    calls = {"n": 0}
    real = cpu_decode.decode_model

    def counted(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(cpu_decode, "decode_model", counted)
    if kind == "gguf_unfused":
        monkeypatch.setattr(cpu_decode, "applies", lambda *args: False)
    prompts = [f"Tell me a short story about the number {i}." for i in range(batch)]
    tokens = 4 if benchmark.disabled else OUTPUT_LEN

    generate = greedy_timer(llm, prompts)

    benchmark.group = f"quantized-decode-b{batch}"
    decode_case(benchmark, generate, tokens, batch, ROUNDS, lambda: calls["n"] > 0,
                kind == "gguf" or (kind == "float32" and batch <= 4), kind=kind)
