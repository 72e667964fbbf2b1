"""Decode of the built-in SmolLM2-135M, batches from the rows where its linears move to oneDNN:
the layers between oneDNN calls (mrv2/models/cpu/onednn_decode.py) against the layer path (the
same model with that path turned off), in the same run; in bfloat16 on a CPU with bfloat16
matrix units (skipped elsewhere: there the path never runs) and in float32. In bfloat16, where
every linear runs on a few-row kernel (AMX tiles or AVX-512 BF16 dot products:
cpu_linear.few_rows_view), the path is one numba call a step; `onednn_loop` runs the same
kernels from its Python loop over the layers instead, and `onednn_linears` the loop with every
linear on oneDNN (the path on a CPU without a few-row kernel).

128-token prompts (token ids, not text: every row the same length), greedy, 64 tokens, EOS
ignored, prefix caching off, 2 threads; one LLM per dtype serves its cases. extra_info
`decode_tokens_per_s` as bench/test_quantized_decode.py computes it (gguf_workload.py).

Under `--benchmark-disable` (CI) each case runs once, 16-token prompts and 4 tokens out, and
checks which path ran.
"""

from __future__ import annotations

import pytest
import torch

from gguf_workload import (decode_case, gguf_path, greedy_timer,
                           shutdown_after_module, token_id_prompts)
from mrv2.models.layers import cpu_linear

ROUNDS = 5
OUTPUT_LEN = 64
PROMPT_LEN = 128
_LLMS: dict = {}

pytestmark = [
    pytest.mark.usefixtures("two_threads"),  # bench/conftest.py
    pytest.mark.skipif(not cpu_linear.available(), reason="torch built without oneDNN"),
]


def _llm(dtype: str):
    from mrv2 import LLM

    if dtype not in _LLMS:
        for llm in _LLMS.values():  # one model in memory at a time
            llm.shutdown()
        _LLMS.clear()
        _LLMS[dtype] = LLM(str(gguf_path()), dtype=dtype, max_model_len=256, max_num_seqs=32,
                           enable_prefix_caching=False)
    return _LLMS[dtype]


_shutdown = shutdown_after_module(_LLMS)


@pytest.mark.parametrize("path", ["onednn", "onednn_loop", "onednn_linears", "layers"])
@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("dtype", [
    pytest.param("bfloat16", marks=pytest.mark.skipif(
        not cpu_linear.computes_natively(torch.bfloat16),
        reason="this CPU has no bfloat16 matrix units")),
    "float32"])
def test_onednn_decode(benchmark, monkeypatch, dtype, batch, path):
    from mrv2.models.cpu.onednn_decode import OneDnnDecode

    llm = _llm(dtype)
    calls = {"n": 0}
    real = OneDnnDecode.__call__

    def counted(self, *args):
        calls["n"] += 1
        return real(self, *args)

    monkeypatch.setattr(OneDnnDecode, "__call__", counted)
    if path == "layers":
        monkeypatch.setattr(OneDnnDecode, "runs", lambda self, rows: False)
    if path in ("onednn_loop", "onednn_linears"):
        if dtype == "float32":
            pytest.skip("a float32 step is always the loop, on oneDNN")
        monkeypatch.setattr(OneDnnDecode, "one_call", property(lambda self: False))
    if path == "onednn_linears":
        monkeypatch.setattr(OneDnnDecode, "step_weights", lambda self: [
            tuple(self.pack(w) for w in weights) for weights in self.weights])
    prompt_len = 16 if benchmark.disabled else PROMPT_LEN
    prompts = token_id_prompts(batch, prompt_len)
    tokens = 4 if benchmark.disabled else OUTPUT_LEN

    generate = greedy_timer(llm, prompts)

    benchmark.group = f"onednn-decode-{dtype}-b{batch}"
    decode_case(benchmark, generate, tokens, batch, ROUNDS, lambda: calls["n"] > 0,
                path != "layers", path=path, dtype=dtype)
