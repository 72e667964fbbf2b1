"""Decode steps between oneDNN linears against the layer path, for a bfloat16 model (on a CPU
that multiplies bfloat16 natively) and a float32 model: the same tokens, and logprobs equal to
within float32 rounding (`LOGPROB_SLACK`), through the engine, taken only for the rows the path
runs, and only for bias-free projections of one of those two kinds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.cpu import onednn_decode
from mrv2.models.cpu.onednn_decode import MAX_ONEDNN_DECODE_ROWS, OneDnnDecode
from mrv2.models.cpu.stack_args import packed_of
from mrv2.models.layers import (cpu_gemv, cpu_linear, dot_linear, linear_plan, quantized,
                                quantized_panel_numba, tile_linear)

native = pytest.mark.skipif(not quantized.computes_natively(torch.bfloat16),
                            reason="this CPU has no bfloat16 matrix units (or no oneDNN)")
onednn = pytest.mark.skipif(not cpu_linear.available(), reason="torch built without oneDNN")
# The fewest rows the path runs per model dtype (OneDnnDecode.min_rows).
MIN_ROWS = {"bfloat16": linear_plan.MIN_NATIVE_HALF_ROWS, "float32": cpu_gemv.MAX_GEMV_ROWS + 1}
DTYPES = [pytest.param("bfloat16", marks=native), pytest.param("float32", marks=onednn)]
# Equal bit for bit in a fresh process. In the suite's cold-cache runs (two workers sharing one
# numba disk cache) the layer path's float32 result differed by up to 1.9e-6 in one logprob in
# about half the runs: in such a process the same answers on every repeat, while a fresh
# process, cold or warm, gives the fast path's. So some layer-path kernel compiled differently
# there (reproduced every time by deleting only decode_numba.decode_kernel's entries from a
# CI run's numba cache): float32 rounding, far below a path's error (one bfloat16 rounding
# moves a logprob ~1e-3).
LOGPROB_SLACK = 1e-5


def _generate(llm: LLM, prompts, use_onednn: bool, monkeypatch) -> tuple[list, int]:
    calls = {"n": 0}
    real = OneDnnDecode.__call__

    def counted(self, *args):
        calls["n"] += 1
        return real(self, *args)

    with monkeypatch.context() as m:
        m.setattr(OneDnnDecode, "__call__", counted)
        if not use_onednn:
            m.setattr(OneDnnDecode, "runs", lambda self, rows: False)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, calls["n"]


def _assert_runs_as_the_layer_path(llm: LLM, prompts, monkeypatch) -> None:
    """This path takes some of the prompts' steps, with the tokens and logprobs (to within
    LOGPROB_SLACK) of the layer path running every step."""
    fast, fast_calls = _generate(llm, prompts, True, monkeypatch)
    plain, plain_calls = _generate(llm, prompts, False, monkeypatch)
    assert fast_calls > 0 and plain_calls == 0
    for a, b in zip(fast, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: p.logprob for t, p in la.items()} == pytest.approx(
                {t: p.logprob for t, p in lb.items()}, rel=0, abs=LOGPROB_SLACK)


@pytest.mark.parametrize("dtype, kv_cache_dtype, rows", [
    pytest.param("bfloat16", "auto", MIN_ROWS["bfloat16"] + 3, marks=native),
    pytest.param("bfloat16", "float16", MIN_ROWS["bfloat16"] + 3, marks=native),
    pytest.param("bfloat16", "auto", 40, marks=native),  # beyond a 32-row pass of the tiles
    pytest.param("float32", "auto", MIN_ROWS["float32"] + 3, marks=onednn),
    pytest.param("float32", "bfloat16", MIN_ROWS["float32"] + 3, marks=onednn)])
def test_same_tokens_and_logprobs_as_the_layer_path(tiny_llama, dtype, kv_cache_dtype, rows,
                                                    monkeypatch):
    llm = LLM(str(tiny_llama), dtype=dtype, max_model_len=128, max_num_seqs=max(16, rows),
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))} for i in range(rows)]
    _assert_runs_as_the_layer_path(llm, prompts, monkeypatch)
    llm.shutdown()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fewer_rows_than_the_linears_take_to_onednn_stay_off(tiny_llama, dtype, monkeypatch):
    llm = LLM(str(tiny_llama), dtype=dtype, max_model_len=128, max_num_seqs=16,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + i))}
               for i in range(MIN_ROWS[dtype] - 1)]
    _, calls = _generate(llm, prompts, True, monkeypatch)
    assert calls == 0
    llm.shutdown()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_runs_from_the_rows_the_linears_take_to_onednn_to_its_maximum(dtype):
    path = OneDnnDecode.__new__(OneDnnDecode)
    path.min_rows = MIN_ROWS[str(dtype).removeprefix("torch.")]
    assert not path.runs(path.min_rows - 1)
    assert path.runs(path.min_rows)
    assert path.runs(MAX_ONEDNN_DECODE_ROWS)
    assert not path.runs(MAX_ONEDNN_DECODE_ROWS + 1)
    # the layer path's 16-bit linears run where the path's do for every row count it takes
    assert MAX_ONEDNN_DECODE_ROWS <= cpu_linear.FEW_ROWS_MAX
    # and never on int8 products (a plan's int8 band starts past every row this path takes)
    assert linear_plan.MIN_INT8_ROWS > MAX_ONEDNN_DECODE_ROWS


@pytest.mark.parametrize("dtype, natively, expected", [
    ("bfloat16", True, torch.bfloat16), ("bfloat16", False, None), ("float16", True, None),
    ("float32", True, torch.float32), ("float32", False, torch.float32)])
def test_only_bfloat16_projections_on_a_native_cpu_or_float32_ones(tiny_llama, monkeypatch,
                                                                   dtype, natively, expected):
    from mrv2.engine.arg_utils import EngineArgs
    from mrv2.models import cpu, load_model

    monkeypatch.setattr(quantized, "computes_natively", lambda d: natively)
    config = EngineArgs(model=str(tiny_llama), dtype=dtype,
                        device="cpu").create_engine_config().model_config
    model = load_model(config, torch.device("cpu"))
    cpu.prepare(model, config)
    path = onednn_decode.onednn_decode(model.model)
    assert (path.dtype if path is not None else None) == expected
    if path is not None:  # from the rows where the layer path's linears move to oneDNN
        assert path.min_rows == MIN_ROWS[dtype]


def test_not_for_gguf_blocks_or_a_biased_projection(tiny_llama, tiny_gguf_factory):
    from mrv2.engine.arg_utils import EngineArgs
    from mrv2.models import cpu, load_model

    config = EngineArgs(model=str(tiny_gguf_factory("llama", "Q8_0")), quantization="gguf",
                        device="cpu").create_engine_config().model_config
    model = load_model(config, torch.device("cpu"))
    cpu.prepare(model, config)
    assert onednn_decode.onednn_decode(model.model) is None
    config = EngineArgs(model=str(tiny_llama), dtype="float32",
                        device="cpu").create_engine_config().model_config
    model = load_model(config, torch.device("cpu"))
    model.model.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(
        model.model.layers[1].self_attn.o_proj.weight.shape[0]))
    assert onednn_decode.onednn_decode(model.model) is None


@pytest.mark.skipif(not (tile_linear.usable() or dot_linear.runs_here()),
                    reason="this CPU has neither AMX tiles nor AVX-512 BF16")
def test_bfloat16_linears_on_the_few_row_kernel_where_the_shapes_allow(tiny_llama):
    """The tiny model's projections are all multiples of 64 wide: on AMX every one is a tile
    view, on AVX-512 BF16 a pair view, kept from the first step on, and a step is one numba
    call (the bit-for-bit test above then runs it); its typed list of the KV caches is kept
    while their memory is, and dropped for Worker.sleep (CpuFastPaths.release_kv_views)."""
    from mrv2.engine.arg_utils import EngineArgs
    from mrv2.models import cpu, load_model

    config = EngineArgs(model=str(tiny_llama), dtype="bfloat16",
                        device="cpu").create_engine_config().model_config
    model = load_model(config, torch.device("cpu"))
    paths = cpu.prepare(model, config)
    path = paths.decode.onednn
    assert not path.one_call  # until the first step packs the weights
    weights = path.step_weights()
    assert all(isinstance(w, np.ndarray) for layer in weights for w in layer)
    assert path.step_weights() is weights and path.one_call
    caches = [torch.zeros(2, 4, 16, 2, 16, dtype=torch.bfloat16) for _ in weights]
    views = path.kv_lists(caches)
    assert path.kv_lists(caches) is views and len(views) == len(weights)
    assert np.shares_memory(views[1], onednn_decode.kv_numba.numpy_view(caches[1]))
    caches[1] = torch.zeros_like(caches[1])  # new memory (wake_up): new views
    assert np.shares_memory(path.kv_lists(caches)[1],
                            onednn_decode.kv_numba.numpy_view(caches[1]))
    paths.release_kv_views()
    assert path._kv_lists is None


@native
@pytest.mark.parametrize("tensor_type", ["Q8_0", "F16"])
def test_gguf_blocks_with_bfloat16_copies_take_onednn_from_the_copys_rows(tiny_gguf_factory,
                                                                          tensor_type,
                                                                          monkeypatch):
    """A GGUF at the defaults on a bfloat16 machine (blocks beside bfloat16 copies,
    loader.cpu_auto_gguf): the fused stack runs up to the blocks' rows, this path from the
    next row on the copies, with the layer path's tokens and logprobs (it reads the copies
    too); fewer rows stay off it. Where oneDNN has VNNI the prefill's rows (more than
    MIN_INT8_ROWS here) run the MLPs on int8 products, integer blocks only."""
    from mrv2.models.layers import int8_linear, mlp
    from mrv2.models.loader import CPU_AUTO_DTYPE_ENV

    monkeypatch.delenv(CPU_AUTO_DTYPE_ENV, raising=False)  # tests/conftest.py pins float32
    int8_calls = []
    real_int8_mlp = mlp.int8_mlp
    monkeypatch.setattr(mlp, "int8_mlp", lambda *args: int8_calls.append(1)
                        or real_int8_mlp(*args))
    llm = LLM(str(tiny_gguf_factory("llama", tensor_type)), max_model_len=128,
              max_num_seqs=16, enable_prefix_caching=False)
    config = llm.llm_engine.config.model_config
    int8 = int8_linear.int8_products_run() and tensor_type != "F16"
    assert config.gguf_bf16_copies and config.gguf_int8_prefill == int8
    fused = llm.llm_engine.engine_core.executor.worker._fast_paths.decode
    qkv = packed_of(fused.model.layers[0].self_attn.qkv_proj)
    panels = qkv.plan.few is linear_plan.LinearKernel.GROUP_PANELS and (
        quantized_panel_numba.panels_prefetch(qkv.group_panels()[0].shape[2]))
    few = (linear_plan.MAX_GROUP_PANEL_ROWS_BESIDE_COPY if panels
           else linear_plan.MAX_BLOCK_ROWS_BESIDE_COPY)
    assert fused.max_rows == few and fused.onednn.min_rows == few + 1
    rows = few + 3
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))} for i in range(rows)]
    _assert_runs_as_the_layer_path(llm, prompts, monkeypatch)
    _, calls = _generate(llm, prompts[:few], True, monkeypatch)
    assert calls == 0
    assert bool(int8_calls) == int8
    llm.shutdown()
