"""The numba twins of gated_delta_rule.py (float32 CPU) against transformers' qwen3_next
functions on per-row slices (the references of test_gated_delta_rule.py): mixed batches with
stale NaN in fresh slots, grouped and equal head counts, odd and even Dk, a prefill split
across two calls, convolution rows shorter than the window, an empty row."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mrv2.models.layers import gated_delta_rule as gdr
from mrv2.models.layers import gated_delta_rule_numba as gdn
from tests.models.test_gated_delta_rule import (TOL, Batch, check_conv, check_delta_rule,
                                                check_split_prefill, gating_inputs, hf_gating,
                                                make_batch)


def _run(batch: Batch, **kwargs) -> torch.Tensor:
    return gdn.gated_delta_rule(*batch.args[:6], batch.query_start_loc.numpy(),
                                *batch.args[7:], use_qk_l2norm=True, scale=None, **kwargs)


# An odd Dk: the memory pass's last row alone.
@pytest.mark.parametrize("heads,dims", [((2, 4), (8, 12)), ((3, 3), (15, 40))])
@torch.no_grad()
def test_delta_rule_matches_transformers(heads, dims) -> None:
    batch = make_batch(heads, dims, seed=heads[0])
    state = batch.state.clone()
    out = _run(replace(batch, state=state))
    assert out.dtype == torch.float32
    check_delta_rule(batch, out, state)


@torch.no_grad()
def test_strided_inputs_and_zero_length_row() -> None:
    """q/k/v as column slices of one projection (as the model splits them); an empty row
    (graph padding) leaves its slot alone."""
    batch = make_batch(lengths=(1, 0, 9), slots=(4, 7, 2), initial=(True, False, False))
    tokens = batch.q.shape[0]
    mixed = torch.cat([x.reshape(tokens, -1) for x in (batch.q, batch.k, batch.v)], 1)
    q, k, v = mixed.split([batch.q[0].numel(), batch.k[0].numel(), batch.v[0].numel()], 1)
    strided = replace(batch, q=q.view(batch.q.shape), k=k.view(batch.k.shape),
                      v=v.view(batch.v.shape), state=batch.state.clone())
    assert not strided.q.is_contiguous()
    check_delta_rule(batch, _run(strided), strided.state)


@torch.no_grad()
def test_prefill_split_across_calls() -> None:
    def run(batch: Batch):
        return _run(batch), batch.state

    check_split_prefill(run, heads=(2, 2), dims=(8, 40))


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
@torch.no_grad()
def test_dispatched_matches_torch_path(use_qk_l2norm: bool) -> None:
    """gated_delta_rule on float32 CPU tensors (numba), the same as the torch path; an
    explicit scale, with and without the l2 norms (then small q and k keep it stable)."""
    batch = make_batch(dims=(16, 8), seed=3)
    batch = replace(batch, q=batch.q * 0.2, k=batch.k * 0.2)
    state, ref_state = batch.state.clone(), batch.state.clone()
    kwargs = dict(scale=0.3, use_qk_l2norm=use_qk_l2norm)
    out = gdr.gated_delta_rule(*replace(batch, state=state).args, **kwargs)
    ref = gdr.gated_delta_rule_torch(*replace(batch, state=ref_state).args, **kwargs)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(state, ref_state, equal_nan=True, **TOL)


@pytest.mark.parametrize("silu,with_bias", [(True, True), (False, False)])
@torch.no_grad()
def test_conv_matches_transformers(silu, with_bias) -> None:
    def conv(x, weight, bias, conv_state, qsl, idx, init, activation_silu):
        return gdn.causal_conv1d(x, weight, bias, conv_state, qsl.numpy(), idx, init,
                                 activation_silu)

    check_conv(conv, silu, with_bias)
    # An empty row, a long row.
    check_conv(conv, silu, with_bias, lengths=(1, 0, 70, 3, 1))


@torch.no_grad()
def test_gating_matches_transformers() -> None:
    args = gating_inputs()
    for got, want in zip(gdn.gdn_gating(*args), hf_gating(*args)):
        torch.testing.assert_close(got, want, **TOL)
