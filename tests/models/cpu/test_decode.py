"""The fused decode stack against the module path: same tokens and logprobs through the
engine, it stays off wherever it does not apply, its cached views follow the tensors, and runs
of decode steps in one call give the step-by-step tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.cpu import decode as cpu_decode
from mrv2.models.cpu import stack_views_numba


def _generate(llm: LLM, prompts, fused: bool, monkeypatch) -> list:
    calls = {"n": 0}
    real = cpu_decode.decode_model

    def counted(*args):
        calls["n"] += 1
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(cpu_decode, "decode_model", counted)
        if not fused:
            m.setattr(cpu_decode, "applies", lambda *args: False)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, calls["n"]


def assert_same_outputs(fused, plain) -> None:
    """Same tokens, same top logprob ids, logprobs within float32 rounding."""
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(la) == list(lb)
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


def _assert_stack_is_the_module_path(llm: LLM, num_prompts: int, monkeypatch) -> None:
    """Steps of `num_prompts` prompts run on the stack and give the module path's tokens and
    logprobs; shuts `llm` down."""
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + 3 * i))} for i in range(num_prompts)]
    try:
        fused, fused_calls = _generate(llm, prompts, True, monkeypatch)
        plain, plain_calls = _generate(llm, prompts, False, monkeypatch)
    finally:
        llm.shutdown()
    assert fused_calls > 0 and plain_calls == 0
    assert_same_outputs(fused, plain)


@pytest.mark.parametrize("num_prompts", [1, 3, cpu_decode.MAX_DECODE_ROWS])
def test_same_tokens_and_logprobs_as_the_module_path(tiny_llama, num_prompts, monkeypatch):
    llm = LLM(str(tiny_llama), max_model_len=128, enable_prefix_caching=False)
    _assert_stack_is_the_module_path(llm, num_prompts, monkeypatch)


def test_bfloat16_cache_same_as_the_module_path(tiny_llama, monkeypatch):
    """kv_cache_dtype="bfloat16": the stack's KV write rounds as torch's does (the module
    path's write), and both read the same 16-bit cache."""
    llm = LLM(str(tiny_llama), max_model_len=128, enable_prefix_caching=False,
              kv_cache_dtype="bfloat16")
    runner = llm.llm_engine.engine_core.executor.worker.runner
    assert all(c.dtype == torch.bfloat16 for c in runner.kv_caches)
    _assert_stack_is_the_module_path(llm, 3, monkeypatch)


# Float activations: x rounded to int8 (the default with AVX2) makes the output a step function
# of x, so the two paths' float32-rounding differences upstream may flip a rounding; the
# kernels' int8 bound is tested in tests/models/test_quantized.py.
@pytest.mark.usefixtures("float_activations")
# Each layout once with and once without a min table, tied and untied (Q4_0 is Q4_1's "u4"
# with mins: test_quantized.py checks its blocks against the file's values); F16 at 8 rows: the
# paired-rows GEMV where no matrix unit or panel takes a 16-bit weight (AVX2).
@pytest.mark.parametrize("tensor_type, tied, num_prompts", [
    ("Q4_1", True, 1), ("Q4_1", False, 8), ("Q8_0", False, 3), ("Q5_1", True, 5),
    ("BF16", True, 3), ("F16", False, 8)])
def test_quantized_stack_matches_the_quantized_module_path(tiny_gguf_factory, tensor_type,
                                                           tied, num_prompts, monkeypatch):
    """quantization="gguf": the stack runs the projections on the attached blocks (u4 and i8
    layouts, with and without mins; 16-bit weights), up to MAX_QUANTIZED_DECODE_ROWS rows, and
    gives the layer by layer quantized path's tokens and logprobs."""
    path = tiny_gguf_factory("llama", tensor_type, tie_word_embeddings=tied)
    llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False, quantization="gguf",
              max_num_seqs=8)
    runner = llm.llm_engine.engine_core.executor.worker.runner
    fused, model = runner.fused_decode, runner.model.model
    assert isinstance(fused, cpu_decode.FusedDecode) and fused.model is model
    assert fused.max_rows == cpu_decode.MAX_QUANTIZED_DECODE_ROWS
    down = model.layers[0].mlp.down_proj
    assert down.packed is not None and down.weight.numel() == 0  # blocks only
    _assert_stack_is_the_module_path(llm, num_prompts, monkeypatch)


@pytest.mark.usefixtures("float_activations")
def test_hybrid_model_on_its_blocks_matches_the_module_path_and_runs_steps(tiny_gguf_factory,
                                                                         monkeypatch):
    """Qwen3.5-MoE from a Q8_0 file: its Gated DeltaNet projections, gated attention and
    experts on their blocks in the stack, the module path's tokens at 3 rows (its float32
    out_proj bounds the stack's rows to MAX_DECODE_ROWS); then runs of 8
    decode steps a call (FusedDecode.run_steps carrying each row's state from step to step)
    give the step-by-step tokens."""
    path = tiny_gguf_factory("qwen3_5_moe", "Q8_0", num_layers=4)
    llm = LLM(str(path), max_model_len=128, quantization="gguf", max_num_seqs=8)
    mixer = llm.llm_engine.engine_core.executor.worker.model.model.layers[0].linear_attn
    # (out_proj is float32 here: its columns regrouped by value head, 16 wide, are not whole
    # blocks; tests/models/gguf/test_qwen3_next_gguf.py)
    assert mixer.in_proj_qkv.packed is not None and mixer.in_proj_z.packed is not None
    _assert_stack_is_the_module_path(llm, 3, monkeypatch)
    _assert_runs_give_step_by_step_tokens(path, monkeypatch)


@pytest.mark.usefixtures("float_activations")
def test_experts_on_the_blocks_match_the_quantized_module_path(tiny_gguf_factory, monkeypatch):
    """Qwen3-MoE's experts as Q4_0 blocks (one view each) in the stack: the module path's
    tokens and logprobs at 5 rows."""
    path = tiny_gguf_factory("qwen3_moe", "Q4_0", num_layers=2, config={
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "norm_topk_prob": True})
    llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False, quantization="gguf")
    runner = llm.llm_engine.engine_core.executor.worker.runner
    assert runner.model.model.layers[1].mlp.experts.packed is not None
    assert runner.fused_decode.max_rows == cpu_decode.MAX_QUANTIZED_DECODE_ROWS
    _assert_stack_is_the_module_path(llm, 5, monkeypatch)


@pytest.mark.parametrize("tensor_type, native, rows", [
    ("BF16", True, "native"), ("BF16", False, "quantized"), ("Q4_1", True, "quantized")])
def test_stack_stops_where_16_bit_linears_move_to_matrix_units(tiny_gguf_factory, tensor_type,
                                                                native, rows, monkeypatch):
    """Where the CPU computes a 16-bit model's dtype natively, its linears of
    MIN_NATIVE_HALF_ROWS rows or more run on the matrix units, so the stack takes fewer."""
    from mrv2 import cpu_caps
    from mrv2.models.layers import linear_plan, quantized

    if native and tensor_type == "BF16" and not cpu_caps.caps().native_16bit(torch.bfloat16):
        pytest.skip("the model's bfloat16 linears need oneDNN's bfloat16, absent on this CPU")
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: native)
    path = tiny_gguf_factory("llama", tensor_type)
    llm = LLM(str(path), max_model_len=64, enable_prefix_caching=False, quantization="gguf",
              max_num_seqs=2)
    fused = llm.llm_engine.engine_core.executor.worker.runner.fused_decode
    llm.shutdown()
    assert fused.max_rows == {
        "native": linear_plan.MIN_NATIVE_HALF_ROWS - 1,
        "quantized": cpu_decode.MAX_QUANTIZED_DECODE_ROWS}[rows]


def test_layers_with_float16_and_float32_scale_tables_share_one_typed_list(tiny_gguf_factory):
    """A file mixing 32-input types (float16 tables) and K-quants (float32) in one projection:
    the stack's list gets float32 tables throughout, of the same values (the float32-table
    kernels are the K-quants' ones)."""
    llm = LLM(str(tiny_gguf_factory("llama", "Q4_1")), max_model_len=64, quantization="gguf")
    model = llm.llm_engine.engine_core.executor.worker.runner.model.model
    downs = [layer.mlp.down_proj for layer in model.layers]
    assert {m.packed.scales.dtype for m in downs} == {torch.int16}
    uniform = stack_views_numba.projection_views(downs)
    assert {v[1].dtype for v in uniform} == {np.dtype(np.int16)}
    downs[0].packed = downs[0].packed._with_float32_tables()
    mixed = stack_views_numba.projection_views(downs)
    llm.shutdown()
    assert {v[1].dtype for v in mixed} == {v[2].dtype for v in mixed} == {np.dtype(np.float32)}
    for view, module in zip(mixed[1:], downs[1:]):
        weight = module.packed
        assert np.array_equal(view[1], weight.scales.view(torch.float16).float().numpy())
        assert np.array_equal(view[2], weight.mins.view(torch.float16).float().numpy())
        if weight.panel_storage:  # the tables are the panels'
            panels, widened = weight.group_panels(), view[6]
            assert widened[1].dtype == widened[2].dtype == np.float32
            for table, wide in zip(panels[1:], widened[1:]):
                assert np.array_equal(wide, table.view(np.float16).astype(np.float32))


def test_off_for_larger_batches(tiny_llama, monkeypatch):
    """More rows than MAX_DECODE_ROWS: never called."""
    llm = LLM(str(tiny_llama), max_model_len=64)
    prompts = [{"prompt_token_ids": [7 + i, 8, 9]} for i in range(cpu_decode.MAX_DECODE_ROWS + 2)]
    _, calls = _generate(llm, prompts, True, monkeypatch)
    assert calls == 0
    llm.shutdown()


ARCHS = {
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "phi3": {"config": {"partial_rotary_factor": 0.5}},
    "smollm3": {"num_layers": 3, "config": {"no_rope_layers": [1, 0, 0]}},
    # Gemma: sandwich norms of 1 + w, scaled embeddings, GeLU, windows, soft caps (Gemma 2),
    # q/k norms and the windowed layers' own rope table (Gemma 3).
    # OLMo 2: no norms before the sublayers, norms after them, q/k norms over projections.
    "olmo2": {},
    # Ministral 3: the queries scaled by position (past 8 tokens here).
    "ministral3": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 8,
                                    "llama_4_scaling_beta": 0.5}},
    "gemma2": {"config": {"sliding_window": 6, "attn_logit_softcapping": 1.5,
                          "final_logit_softcapping": 8.0, "query_pre_attn_scalar": 24,
                          "layer_types": ["sliding_attention", "full_attention"]}},
    "gemma3": {"num_layers": 3, "config": {
        "sliding_window": 7, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}},
    # Gemma 4: wider global heads whose values are their keys, value norms, per-layer inputs,
    # the last two layers reading layers 1's and 2's caches with double-wide MLPs.
    "gemma4": {"num_layers": 5, "tie_word_embeddings": True, "config": {
        "sliding_window": 7, "layer_types": ["sliding_attention", "sliding_attention",
                                             "full_attention", "sliding_attention",
                                             "full_attention"],
        "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 2048,
        "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
        "final_logit_softcapping": 10.0}},
    # Qwen2-MoE: routed experts (top-3 of 8, not renormalised) every 2nd layer with a shared
    # expert behind its gate, a dense MLP in the others (moe_numba.py).
    "qwen2_moe": {"num_layers": 3, "config": {
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2}},
    # gpt-oss: attention sinks, a window every other layer, YaRN, a router bias, experts with
    # biases and the clamped SwiGLU (its limit biting at 1.0).
    "gpt_oss": {"num_layers": 2, "max_position_embeddings": 128, "rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}, "config": {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
        "swiglu_limit": 1.0, "layer_types": ["sliding_attention", "full_attention"]}},
    # Qwen3.5: three Gated DeltaNet layers (their state per request slot), then one of gated
    # attention with partial rotary and (1 + w) q/k norms; Qwen3-Next: its projections grouped
    # per key head, MoE with the gated shared expert (Qwen3.5-MoE: on its blocks, below).
    "qwen3_5": {"num_layers": 4},
    "qwen3_next": {"num_layers": 4},
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_each_architecture_same_as_the_module_path(tiny_model_factory, arch, monkeypatch):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms (its head_dim not hidden / heads),
    Phi-3's partial rotary, SmolLM3's NoPE layers, OLMo 2's norms, Ministral 3's query scaling,
    Gemma's traits, routed experts, gpt-oss's sinks and experts and Qwen3.5's and Qwen3-Next's
    linear-attention layers and gated attention are computed inside the stack as the module
    path computes them."""
    path = tiny_model_factory(arch, **ARCHS[arch])
    llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False)
    assert llm.llm_engine.engine_core.executor.worker.runner.fused_decode is not None
    _assert_stack_is_the_module_path(llm, 3, monkeypatch)


def test_no_fused_path_for_layers_it_does_not_compute(tiny_model_factory):
    """Checked once on the loaded weights (`qualifies`): a q/k norm of another eps than the
    layer norms (the kernel takes one), a q norm without a k norm, a bias that is not float32,
    a projection split over ranks, layers of different norm eps: the module path."""
    from mrv2.engine.arg_utils import EngineArgs
    from mrv2.models import load_model

    def loaded(arch: str):
        config = EngineArgs(model=str(tiny_model_factory(arch)), dtype="float32",
                            device="cpu").create_engine_config().model_config
        model = load_model(config, torch.device("cpu"))
        assert cpu_decode.fused_decode(model) is not None
        return model

    model = loaded("qwen3")
    model.model.layers[1].self_attn.q_norm.eps = 1e-3
    assert cpu_decode.fused_decode(model) is None
    model = loaded("qwen3")
    model.model.layers[0].self_attn.k_norm = None
    assert cpu_decode.fused_decode(model) is None
    model = loaded("qwen2")
    qkv = model.model.layers[1].self_attn.qkv_proj
    qkv.bias = torch.nn.Parameter(qkv.bias.detach().bfloat16(), requires_grad=False)
    assert cpu_decode.fused_decode(model) is None
    model = loaded("llama")
    model.model.layers[0].mlp.down_proj.tp_size = 2
    assert cpu_decode.fused_decode(model) is None
    model = loaded("llama")
    for norm in ("input_layernorm", "post_attention_layernorm"):
        getattr(model.model.layers[1], norm).eps = 1e-3
    assert cpu_decode.fused_decode(model) is None


def test_off_with_autograd_or_other_dtypes(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64)
    model = llm.llm_engine.engine_core.executor.worker.runner.model.model
    llm.shutdown()

    class Meta:
        num_decodes = num_reqs = num_actual_tokens = 1

    caches = [torch.zeros(2, 4, 16, 2, 8) for _ in model.layers]
    with torch.no_grad():
        assert cpu_decode.applies(model, torch.zeros(1, 64), caches, Meta)
        assert not cpu_decode.applies(model, torch.zeros(1, 64).double(), caches, Meta)
        assert cpu_decode.applies(model, torch.zeros(1, 64), [c.bfloat16() for c in caches],
                                  Meta)
        assert not cpu_decode.applies(model, torch.zeros(1, 64), [c.double() for c in caches],
                                      Meta)
    assert not cpu_decode.applies(model, torch.zeros(1, 64), caches, Meta)  # grad mode


def test_views_follow_new_weight_storage(tiny_llama, monkeypatch):
    """A parameter given new storage after the first decode step is read from its new
    storage: the cached views are rebuilt, never left pointing at the old memory."""
    llm = LLM(str(tiny_llama), max_model_len=128, enable_prefix_caching=False)
    model = llm.llm_engine.engine_core.executor.worker.runner.model.model
    prompts = [{"prompt_token_ids": list(range(5, 25))}]
    before, _ = _generate(llm, prompts, True, monkeypatch)
    weight = model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        weight.data = torch.zeros_like(weight) + 0.05  # new storage, other values
    fused, fused_calls = _generate(llm, prompts, True, monkeypatch)
    plain, _ = _generate(llm, prompts, False, monkeypatch)
    llm.shutdown()
    assert fused_calls > 0
    assert fused[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert fused[0].outputs[0].token_ids != before[0].outputs[0].token_ids


def _assert_runs_give_step_by_step_tokens(path, monkeypatch) -> None:
    """A GGUF model's greedy tokens on its blocks with num_scheduler_steps 8, through runs of
    the stack (FusedDecode.run_steps), are one step's at a time."""
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    runs: list[tuple[int, int]] = []
    run_steps = cpu_decode.FusedDecode.run_steps

    def spy(self, *args):
        out = run_steps(self, *args)
        runs.append(None if out is None else tuple(out[0].shape))
        return out

    tokens = {}
    with monkeypatch.context() as m:
        m.setattr(cpu_decode.FusedDecode, "run_steps", spy)
        for steps in (1, 8):
            llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False,
                      quantization="gguf", max_num_seqs=4, num_scheduler_steps=steps)
            tokens[steps] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                           use_tqdm=False)]
            llm.shutdown()
    assert tokens[8] == tokens[1] and (3, 8) in runs and None not in runs


# Ministral 3 scales its queries by 1 + beta * log(1 + floor(position / 32)): the runs cross
# position 32, so their steps see both a scale of 1 and a larger one.
MINISTRAL3_SCALED = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5,
                                      "original_max_position_embeddings": 32}}


@pytest.mark.parametrize("arch, tensor_type, kwargs", [
    ("llama", "Q4_0", {}), ("ministral3", "Q8_0", MINISTRAL3_SCALED)])
def test_runs_of_decode_steps_give_the_step_by_step_tokens(tiny_gguf_factory, arch,
                                                          tensor_type, kwargs, monkeypatch):
    """num_scheduler_steps: a run's further steps go through FusedDecode.run_steps (the stack
    and its argmax in one call, on the blocks' panels) and give one step's tokens at a time."""
    _assert_runs_give_step_by_step_tokens(tiny_gguf_factory(arch, tensor_type, **kwargs),
                                          monkeypatch)
