"""The Triton twins of gated_delta_rule.py: interpreted on CPU tensors against transformers'
qwen3_next functions on per-row slices (the references of test_gated_delta_rule.py), compiled
on a GPU against the torch path (float32 and bfloat16, no recompiles as batches change)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mrv2 import platform
from mrv2.models.layers import gated_delta_rule as gdr
from mrv2.models.layers import gated_delta_rule_triton as gdt
from tests.models.test_gated_delta_rule import (TOL, Batch, check_conv, check_delta_rule,
                                                check_split_prefill, gating_inputs, hf_gating,
                                                make_batch, make_conv)
from tests.models.triton_layer_helpers import COMPILED_TOL, compiled_variants, needs_cuda


def _run(batch: Batch) -> torch.Tensor:
    with platform.triton_interpreter():
        return gdr.gated_delta_rule(*batch.args)


@torch.no_grad()
def test_delta_rule_matches_transformers() -> None:
    """Grouped heads, Dk != Dv (a masked Dv block), the engine's mixed batch."""
    batch = make_batch((2, 4), (8, 12), seed=1)
    state = batch.state.clone()
    out = _run(replace(batch, state=state))
    check_delta_rule(batch, out, state)


@torch.no_grad()
def test_equal_heads_two_value_blocks_and_empty_row() -> None:
    """Hk == Hv, Dv = 40 (a full DELTA_BLOCK_V block and a partial one), Dk not a power of
    two; an empty row (graph padding) leaves its slot alone."""
    batch = make_batch((2, 2), (6, 40), lengths=(1, 0, 9, 2), slots=(4, 7, 2, 0),
                       initial=(True, False, False, True), seed=2)
    state = batch.state.clone()
    out = _run(replace(batch, state=state))
    check_delta_rule(batch, out, state)


@torch.no_grad()
def test_scale_without_l2norm_matches_torch_path() -> None:
    batch = make_batch((2, 2), (8, 8), lengths=(1, 4), slots=(1, 0), initial=(True, False))
    batch = replace(batch, q=batch.q * 0.2, k=batch.k * 0.2)
    state, ref_state = batch.state.clone(), batch.state.clone()
    kwargs = dict(scale=0.3, use_qk_l2norm=False)
    with platform.triton_interpreter():
        out = gdr.gated_delta_rule(*replace(batch, state=state).args, **kwargs)
    ref = gdr.gated_delta_rule_torch(*replace(batch, state=ref_state).args, **kwargs)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(state, ref_state, equal_nan=True, **TOL)


@torch.no_grad()
def test_prefill_split_across_calls() -> None:
    def run(batch: Batch):
        return _run(batch), batch.state

    check_split_prefill(run, heads=(1, 2), dims=(8, 8), total=20, split=12)


@pytest.mark.parametrize("silu,with_bias", [(True, True), (False, False)])
@torch.no_grad()
def test_conv_matches_transformers(silu, with_bias) -> None:
    def conv(*args, activation_silu):
        with platform.triton_interpreter():
            return gdr.causal_conv1d(*args, activation_silu=activation_silu)

    check_conv(conv, silu, with_bias)
    if silu:  # two channel blocks (the second partial), an empty row, a long row
        check_conv(conv, channels=gdt.CONV_BLOCK_C + 3, lengths=(1, 0, 20, 3, 1))


@torch.no_grad()
def test_gating_matches_transformers() -> None:
    args = gating_inputs()
    with platform.triton_interpreter():
        got = gdr.gdn_gating(*args)
    for g, want in zip(got, hf_gating(*args)):
        torch.testing.assert_close(g, want, **TOL)


def _to(batch: Batch, device: str, dtype: torch.dtype) -> Batch:
    moved = {name: getattr(batch, name).to(device) for name in batch.__dataclass_fields__}
    for name in ("q", "k", "v"):
        moved[name] = moved[name].to(dtype)
    return Batch(**moved)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_compiled_matches_torch(dtype: torch.dtype) -> None:
    """Qwen3-Next's head shapes (Dk = Dv = 128, Hk = 16, Hv = 32) on batches of changing
    sizes: the same kernels serve them all."""
    first = None
    for step, lengths in enumerate([(1, 1, 5, 70, 3), (1,) * 7, (130, 1), (3, 2, 1)]):
        rows = len(lengths)
        batch = _to(make_batch((16, 32), (128, 128), lengths=lengths, slots=tuple(range(rows)),
                               initial=tuple(r % 2 == 0 for r in range(rows)), seed=step),
                    "cuda", dtype)
        state, ref_state = batch.state.clone(), batch.state.clone()
        out = gdr.gated_delta_rule(*replace(batch, state=state).args)
        with platform.forced_impl(platform.CPU):  # the torch path on CUDA tensors
            ref = gdr.gated_delta_rule(*replace(batch, state=ref_state).args)
        tol = COMPILED_TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.float(), ref.float(), **tol)
        torch.testing.assert_close(state, ref_state, equal_nan=True, rtol=1e-4, atol=1e-4)

        x, weight, bias, conv_state, qsl, idx, init = (
            t.to("cuda") for t in make_conv(channels=2 * 16 * 128 + 32 * 128, lengths=lengths,
                                            slots=tuple(range(rows)),
                                            initial=tuple(r % 2 == 0 for r in range(rows))))
        conv_ref_state = conv_state.clone()
        conv_out = gdr.causal_conv1d(x.to(dtype), weight, bias, conv_state, qsl, idx, init)
        with platform.forced_impl(platform.CPU):
            conv_ref = gdr.causal_conv1d(x.to(dtype), weight, bias, conv_ref_state, qsl, idx,
                                         init)
        torch.testing.assert_close(conv_out.float(), conv_ref.float(), **COMPILED_TOL[dtype])
        torch.testing.assert_close(conv_state, conv_ref_state, equal_nan=True, **TOL)
        if step == 0:
            first = (compiled_variants(gdt._delta_rule_kernel),
                     compiled_variants(gdt._conv_kernel))
    assert (compiled_variants(gdt._delta_rule_kernel),
            compiled_variants(gdt._conv_kernel)) == first
