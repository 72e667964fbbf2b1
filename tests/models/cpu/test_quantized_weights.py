"""GGUF weights computed as stored: a model loaded from a quantized GGUF file on the CPU has its
linears, embedding and (tied) LM head on the file's blocks, its float32 copies released, and
computes what the dequantized float32 model computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError
from mrv2.engine.arg_utils import EngineArgs
from mrv2.models.cpu import prepare
from mrv2.models.cpu.quantized_weights import pack_gguf_weights
from mrv2.models.gguf import GGUFWeight
from mrv2.models.loader import load_model

CPU = torch.device("cpu")


def _configs(path, **kwargs):
    return EngineArgs(model=str(path), max_model_len=64, **kwargs).create_engine_config()


def _dequantized(model_config):
    """The same file loaded as float32 weights (quantization off): the reference."""
    return load_model(dataclasses.replace(model_config, quantization=None), CPU)


def _quantized(path, **kwargs) -> LLM:
    return LLM(str(path), max_model_len=64, quantization="gguf", **kwargs)


@pytest.mark.usefixtures("float_activations")
@pytest.mark.parametrize("tensor_type, tied", [("Q8_0", False), ("Q4_0", True),
                                               ("Q4_1", False), ("BF16", True)])
def test_quantized_model_computes_what_the_dequantized_one_does(tiny_gguf_factory, tensor_type,
                                                                tied):
    path = tiny_gguf_factory("llama", tensor_type, tie_word_embeddings=tied)
    config = _configs(path, quantization="gguf").model_config
    reference = _dequantized(config)  # the loader's dequantized float32 weights
    model = load_model(config, CPU)  # packed by the loader
    paths = prepare(model, config)
    attached = set(paths.packed.weights)
    layers = {f"model.layers.{i}.{m}" for i in range(len(model.model.layers))
              for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                        "mlp.down_proj")}
    assert layers <= attached and "model.embed_tokens" in attached
    assert ("lm_head" in attached) is (not tied)
    assert paths.decode is not None  # the fused decode stack runs on the blocks too
    assert model.model.layers[0].mlp.down_proj.packed is paths.packed.weights[
        "model.layers.0.mlp.down_proj"]
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0  # released
    ids = torch.tensor([5, 17, 300, 42, 1000, 7])
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
        expected_hidden = reference.model.embed_tokens(ids)
        # Same dequantized values, summed in another order: float32 rounding apart.
        torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=0)
        h = torch.randn(3, hidden.shape[1], generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(model.compute_logits(h), reference.compute_logits(h),
                                   rtol=1e-4, atol=1e-4)
        mlp, ref_mlp = model.model.layers[0].mlp, reference.model.layers[0].mlp
        x = torch.randn(5, h.shape[1], generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(mlp(x), ref_mlp(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tensor_type, tied, tensor_types", [
    ("Q4_1", False, None), ("Q8_0", True, None), ("BF16", False, None),
    ("Q4_0", True, {"attn_v.weight": "Q8_0", "ffn_down.weight": "Q8_0"}),
    # A 16-bit v beside integer q / k: that qkv_proj keeps its float32 weight.
    ("Q8_0", False, {"attn_v.weight": "F16"})])
def test_the_loader_packs_what_packing_a_loaded_model_would_never_dequantizing_it(
        tiny_gguf_factory, monkeypatch, tensor_type, tied, tensor_types):
    """Issue 48: load_model packs the blocks itself instead of dequantizing them into float32
    parameters first. The same modules get the same weights as packing the float32-loaded
    model did, the rest loads as float32, and no packed tensor is ever dequantized."""
    path = tiny_gguf_factory("llama", tensor_type, tensor_types=tensor_types,
                             tie_word_embeddings=tied)
    config = _configs(path, quantization="gguf").model_config
    reference = _dequantized(config)
    expected = pack_gguf_weights(reference, config)  # packing after a float32 load
    dequantized: list[str] = []
    read = GGUFWeight.__getitem__

    def recording_read(self, index):
        dequantized.append(self.record.name)
        return read(self, index)

    monkeypatch.setattr(GGUFWeight, "__getitem__", recording_read)
    model = load_model(config, CPU)
    assert dequantized  # the norms at least
    packed_files = {w.record.name for n, w in _file_tensors(config)
                    if n in expected.checkpoint_names}
    assert packed_files and not packed_files & set(dequantized)
    got = prepare(model, config).packed.weights
    assert got.keys() == expected.weights.keys()
    assert (tensor_types is None or "F16" not in tensor_types.values()) is (
        "model.layers.0.self_attn.qkv_proj" in got)
    for name, weight in got.items():
        want = expected.weights[name]
        assert (weight.layout, weight.group_size, weight.gguf_type, weight.panel_storage) == (
            want.layout, want.group_size, want.gguf_type, want.panel_storage), name
        pairs = list(zip(weight.storage_tensors(), want.storage_tensors(), strict=True))
        assert all(torch.equal(a, b) for a, b in pairs), name
    for (name, param), (_, ref_param) in zip(model.named_parameters(),
                                             reference.named_parameters(), strict=True):
        assert torch.equal(param, ref_param), name  # released (empty) alike, or loaded alike


def _file_tensors(model_config):
    from mrv2.models.gguf import iterate_gguf_weights, open_gguf

    return list(iterate_gguf_weights(open_gguf(model_config.model), model_config.hf_config))


@pytest.mark.usefixtures("float_activations")
def test_llm_generates_the_dequantized_models_tokens(tiny_gguf_factory):
    """Greedy tokens through the engine (prefill, and decode of six rows) equal those of the
    loader's dequantized float32 model driven by the same engine."""
    path = tiny_gguf_factory("llama", "Q8_0")
    prompts = [{"prompt_token_ids": [5, 17, 300, 42 + i, 1000, 7]} for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = _quantized(path, max_num_seqs=8)
    worker = llm.llm_engine.engine_core.executor.worker
    assert worker.model.model.layers[0].mlp.down_proj.weight.numel() == 0
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    _run_float32_reference(llm)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == want


def _run_float32_reference(llm: LLM) -> None:
    """Swap the loader's float32 weights of the same file into `llm`'s engine, run by the
    model's own forward (the fused decode built on the blocks dropped)."""
    worker = llm.llm_engine.engine_core.executor.worker
    worker.model = _dequantized(llm.llm_engine.engine_core.config.model_config)
    assert worker.model.model.layers[0].self_attn.o_proj.packed is None
    worker.runner.model, worker.runner.fused_decode = worker.model, None


@pytest.mark.usefixtures("float_activations")
def test_shards_of_different_layouts_are_fused_as_bytes(tiny_gguf_factory):
    """A Q4_K_M-like file: 4-bit q / k beside an 8-bit v (and 4-bit layers whose down
    projection is 8-bit). The fused q/k/v takes one byte layout holding the same values, so the
    layer stays on the blocks and the decode stack runs: greedy tokens equal those of the
    loader's dequantized float32 model in the same engine."""
    path = tiny_gguf_factory("llama", "Q4_0", tensor_types={"attn_v.weight": "Q8_0",
                                                            "ffn_down.weight": "Q8_0"})
    config = _configs(path, quantization="gguf").model_config
    reference = _dequantized(config)
    model = load_model(config, CPU)
    paths = prepare(model, config)
    qkv = paths.packed.weights["model.layers.0.self_attn.qkv_proj"]
    assert (qkv.layout, qkv.group_size, qkv.gguf_type) == ("i8", 32, "Q4_0+Q8_0")
    assert paths.packed.weights["model.layers.0.mlp.gate_up_proj"].layout == "u4"
    assert paths.decode is not None
    x = torch.randn(3, config.hf_config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        attn, ref_attn = model.model.layers[0].self_attn, reference.model.layers[0].self_attn
        torch.testing.assert_close(attn.qkv_proj(x), ref_attn.qkv_proj(x), rtol=1e-4, atol=1e-4)

    prompts = [{"prompt_token_ids": [5, 17, 300, 42 + i, 1000, 7]} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = _quantized(path, max_num_seqs=4)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    _run_float32_reference(llm)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == want


def test_quantization_option(tiny_gguf_factory, tiny_llama):
    # Off unless asked for: dequantized float32 is the faster path on the CPUs measured.
    assert _configs(tiny_gguf_factory("llama", "Q8_0")).model_config.quantization is None
    assert _configs(tiny_gguf_factory("llama", "Q8_0"),
                    quantization="gguf").model_config.quantization == "gguf"
    with pytest.raises(ConfigError, match="stored quantized"):
        _configs(tiny_llama, quantization="gguf")
    with pytest.raises(ConfigError, match="stored quantized or in 16 bits"):
        _configs(tiny_gguf_factory("llama", "F32"), quantization="gguf")
    assert _configs(tiny_gguf_factory("llama", "F16"),
                    quantization="gguf").model_config.quantization == "gguf"
    with pytest.raises(ConfigError, match="CPU only"):
        _configs(tiny_gguf_factory("llama", "Q8_0"), quantization="gguf", device="cuda")
    with pytest.raises(ConfigError, match="not supported"):
        _configs(tiny_llama, quantization="awq")


def _bf16_checkpoint(src, dst):
    """A copy of the model at `src` with its weights stored as bfloat16 (as most Hub
    checkpoints are)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.usefixtures("float_activations")  # x stays float32 in every linear
def test_16bit_model_keeps_16bit_weights_and_float32_activations(tiny_model_factory, tmp_path,
                                                                 native, monkeypatch):
    # With or without 16-bit matrix instructions on the CPU (where it has them, linears of
    # several rows use them: test_quantized.py bounds their rounding).
    from mrv2 import platform

    monkeypatch.setattr(platform, "cpu_computes_natively",
                        lambda dtype: native or dtype == torch.float32)
    path = _bf16_checkpoint(tiny_model_factory("llama", tie_word_embeddings=True),
                            tmp_path / "bf16")
    config = _configs(path, dtype="bfloat16").model_config
    assert (config.dtype, config.cpu_weight_dtype) == (torch.float32, torch.bfloat16)
    assert _configs(path).model_config.cpu_weight_dtype is None  # "auto": float32 weights
    model = load_model(config, CPU)
    paths = prepare(model, config)
    weights = paths.packed.weights
    assert {w.layout for w in weights.values()} == {"bf16"} and "model.embed_tokens" in weights
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0  # released
    assert paths.decode is not None  # the fused decode stack runs on them

    # The checkpoint's weights are bfloat16: kept as such they are exact, so the engine gives
    # the float32 model's greedy tokens (float32 sums in another order: logprobs ~1e-6, up to
    # 2e-4 for the first prompt on a Zen 4, whose AVX-512 kernels sum in yet another order and
    # whose hidden states that prompt makes ill-conditioned; x rounded to bfloat16 moves them
    # by 1e-3 and more) when that model stores its KV cache in bfloat16 too, as "auto" does
    # for the bfloat16 model.
    prompts = [{"prompt_token_ids": [5, 17, 300, 42 + i, 1000, 7]} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = {}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(str(path), dtype=dtype, max_model_len=64, enable_prefix_caching=False,
                  kv_cache_dtype="auto" if dtype == "bfloat16" else "bfloat16")
        assert llm.llm_engine.config.kv_cache_dtype == torch.bfloat16
        outputs[dtype] = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        llm.shutdown()
    for got, want in zip(outputs["bfloat16"], outputs["float32"]):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) < 5e-4


@pytest.mark.parametrize("rows", [1, 2, 4, 40, 70])
def test_16bit_lm_head_gives_float32_logits_at_every_row_count(tiny_model_factory, tmp_path,
                                                               rows):
    """Issue 47: from 2 rows the head ran on the matrix units and rounded its logits to
    bfloat16, whose grid tied the France chat's top two tokens. Every row count gives float32
    sums now: off the bfloat16 grid, within the bound of x rounded to bfloat16 and float32
    sums (test_cpu_linear.bf16_float32_sums_bound)."""
    from mrv2.models.layers.linear_plan import LinearKernel

    path = _bf16_checkpoint(tiny_model_factory("llama", tie_word_embeddings=False),
                            tmp_path / "bf16")
    config = _configs(path, dtype="bfloat16").model_config
    model = load_model(config, CPU)
    paths = prepare(model, config)
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    w = _bf16_checkpoint_weight(path, "lm_head.weight")
    h = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)) * 3
    with torch.no_grad():
        logits = model.compute_logits(h)
    assert head.weight.numel() == 0 and logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())
    # Beyond the GEMV's rows x is rounded to bfloat16 for the matrix units (or their stand-in).
    plan = paths.packed.weights["lm_head"].plan
    on_units = plan.kernel_for(rows) is LinearKernel.NATIVE_16BIT
    x = h.bfloat16().double() if on_units else h.double()
    error = (logits.double() - x @ w.double().T).abs()
    bound = w.shape[1] * 2.0 ** -24 * (x.abs() @ w.double().abs().T) + 1e-30
    assert bool((error <= bound).all()), (error / bound).max().item()


def _bf16_checkpoint_weight(path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))[name].float()


def _assert_blocks_give_the_float32_tokens(llm: LLM) -> None:
    """Greedy tokens of three prompts on `llm`'s packed weights equal those of the same file's
    dequantized float32 model in the same engine; shuts `llm` down."""
    prompts = [{"prompt_token_ids": [5, 17, 300, 42 + i, 1000, 7, 8, 9]} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    _run_float32_reference(llm)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.shutdown()
    assert got == want


GEMMA4 = {"num_layers": 5, "tie_word_embeddings": True, "config": {
    "sliding_window": 5, "layer_types": ["sliding_attention", "sliding_attention",
                                         "full_attention", "sliding_attention",
                                         "full_attention"],
    "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 2048,
    "num_kv_shared_layers": 2, "use_double_wide_mlp": True}}


@pytest.mark.usefixtures("float_activations")
def test_gemma4_every_weight_on_the_blocks_and_the_fused_stack(tiny_gguf_factory,
                                                               tiny_model_factory):
    """Gemma 4's q+k and q-only projections, its per-layer linears and its per-layer table are
    packed from the file (none dequantized: E2B's per-layer table alone is 2.3B values), the
    fused stack runs them, and greedy tokens equal the dequantized model's; a 16-bit model
    keeps them 16-bit."""
    from mrv2.models.cpu.quantized_weights import pack_16bit_weights

    path = tiny_gguf_factory("gemma4", "Q8_0", **GEMMA4)
    llm = _quantized(path, max_num_seqs=4)
    worker = llm.llm_engine.engine_core.executor.worker
    inner = worker.model.model
    linears = [m for name, m in inner.named_modules() if name.endswith(
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "per_layer_input_gate",
         "per_layer_projection", "per_layer_model_projection"))]
    assert len(linears) == 5 * 6 + 1 and all(m.packed is not None for m in linears)
    assert inner.embed_tokens_per_layer.packed is not None
    assert worker.runner.fused_decode is not None
    _assert_blocks_give_the_float32_tokens(llm)
    model = load_model(_configs(tiny_model_factory("gemma4", **GEMMA4)).model_config, CPU)
    packed = pack_16bit_weights(model, torch.bfloat16)
    assert {"model.embed_tokens_per_layer", "model.per_layer_model_projection",
            "model.layers.4.per_layer_projection", "model.layers.4.self_attn.qkv_proj"
            } <= set(packed.weights)


@pytest.mark.usefixtures("float_activations")
@pytest.mark.parametrize("arch, kwargs", [
    ("qwen2_moe", {"num_layers": 2, "config": {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96}}),
    ("mixtral", {"num_layers": 2, "config": {"num_local_experts": 4, "num_experts_per_tok": 2}}),
])
def test_moe_experts_on_the_blocks_give_the_dequantized_models_tokens(tiny_gguf_factory, arch,
                                                                      kwargs):
    """A MoE file's experts are packed per expert from its 3-D tensors (gate and up stacked,
    never dequantized) and compute on them: greedy tokens equal the dequantized model's."""
    path = tiny_gguf_factory(arch, "Q8_0", **kwargs)
    llm = _quantized(path, max_num_seqs=4)
    worker = llm.llm_engine.engine_core.executor.worker
    experts = [layer.mlp.experts for layer in worker.model.model.layers]
    assert all(e.packed is not None and e.gate_up_proj.numel() == 0 for e in experts)
    assert experts[0].packed[0][0].out_features == 2 * experts[0].intermediate_size
    _assert_blocks_give_the_float32_tokens(llm)
