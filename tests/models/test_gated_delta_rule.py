"""gated_delta_rule.py's torch path and dispatch against transformers' qwen3_next functions,
called on per-row slices: mixed decode / prefill batches with fresh and continuing rows, stale
garbage in fresh slots, scattered slots, grouped heads, a prefill split across two calls, and
convolution rows shorter than the window.

The batch builders and the per-row references here are shared with the numba and Triton twins'
tests (test_gated_delta_rule_numba.py, test_gated_delta_rule_triton.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from mrv2 import platform
from mrv2.models.layers import gated_delta_rule as gdr
from mrv2.models.layers import gated_delta_rule_numba

TOL = dict(rtol=1e-5, atol=1e-5)  # float32; chunked vs recurrent differ at ~1e-6
NUM_SLOTS = 8
# The engine's order: decode rows first, then prefill rows; fresh and continuing rows of each.
LENGTHS = (1, 1, 5, 70, 3)
SLOTS = (3, 0, 5, 1, 6)
INITIAL = (True, False, True, False, True)


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor  # [NUM_SLOTS, Hv, Dk, Dv]: NaN in fresh slots, random elsewhere
    query_start_loc: torch.Tensor
    state_index: torch.Tensor
    has_initial_state: torch.Tensor

    @property
    def args(self) -> tuple:
        return (self.q, self.k, self.v, self.g, self.beta, self.state, self.query_start_loc,
                self.state_index, self.has_initial_state)


def layout(lengths, slots, initial) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query_start_loc, state_index, has_initial_state) of rows of `lengths`."""
    starts = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return (starts, torch.tensor(slots, dtype=torch.int32),
            torch.tensor(initial, dtype=torch.bool))


def garbage_slots(shape, slots, initial, seed: int) -> torch.Tensor:
    """Random state with NaN in the fresh rows' slots (stale data must never be read)."""
    state = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    for slot, init in zip(slots, initial):
        if not init:
            state[slot] = float("nan")
    return state


def make_batch(heads=(2, 4), dims=(8, 12), lengths=LENGTHS, slots=SLOTS, initial=INITIAL,
               seed: int = 0) -> Batch:
    (hk, hv), (dk, dv) = heads, dims
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    a, b = torch.randn(tokens, hv, generator=gen), torch.randn(tokens, hv, generator=gen)
    a_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen)
    g, beta = gdr.gdn_gating_torch(a, b, a_log, dt_bias)
    return Batch(torch.randn(tokens, hk, dk, generator=gen),
                 torch.randn(tokens, hk, dk, generator=gen),
                 torch.randn(tokens, hv, dv, generator=gen), g, beta,
                 garbage_slots((NUM_SLOTS, hv, dk, dv), slots, initial, seed + 1),
                 *layout(lengths, slots, initial))


def hf_delta_rule(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' recurrent (one-token rows) or chunked (longer rows) function on each
    row's slice -> (out, state after the step)."""
    state = batch.state.clone()
    out = torch.zeros(batch.v.shape)
    starts = batch.query_start_loc.tolist()
    for r, (slot, init) in enumerate(zip(batch.state_index.tolist(),
                                         batch.has_initial_state.tolist())):
        rows = slice(starts[r], starts[r + 1])
        if rows.start == rows.stop:
            continue
        fn = (hf.torch_recurrent_gated_delta_rule if rows.stop - rows.start == 1
              else hf.torch_chunk_gated_delta_rule)
        o, final = fn(*(x[None, rows] for x in (batch.q, batch.k, batch.v, batch.g, batch.beta)),
                      initial_state=state[slot:slot + 1] if init else None,
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        out[rows], state[slot] = o[0], final[0]
    return out, state


def check_delta_rule(batch: Batch, out: torch.Tensor, state: torch.Tensor) -> None:
    """out and the rows' slots against `hf_delta_rule`; every other slot untouched."""
    ref_out, ref_state = hf_delta_rule(batch)
    torch.testing.assert_close(out, ref_out, **TOL)
    used = batch.state_index.long()
    torch.testing.assert_close(state[used], ref_state[used], equal_nan=True, **TOL)
    others = [s for s in range(NUM_SLOTS) if s not in used.tolist()]
    assert torch.equal(state[others], batch.state[others])


def check_split_prefill(run, heads=(2, 4), dims=(8, 12), total: int = 70, split: int = 40
                        ) -> None:
    """A `total`-token prefill in one call equals the same tokens in two calls (state
    carried), each call next to a decode row; `run(batch) -> (out, state)` updates
    batch.state."""
    whole = make_batch(heads, dims, lengths=(1, total), slots=(2, 4), initial=(True, False))
    out_whole, state_whole = run(replace(whole, state=whole.state.clone()))
    first, second = (replace(whole, query_start_loc=qsl, state_index=idx, has_initial_state=init)
                     for qsl, idx, init in (layout((1, split), (2, 4), (True, False)),
                                            layout((total - split,), (4,), (True,))))
    state = whole.state.clone()
    out_1, state = run(replace(first, **_tokens(whole, slice(0, 1 + split)), state=state))
    out_2, state = run(replace(second, **_tokens(whole, slice(1 + split, 1 + total)),
                               state=state))
    torch.testing.assert_close(torch.cat([out_1, out_2]), out_whole, **TOL)
    torch.testing.assert_close(state, state_whole, **TOL)
    torch.testing.assert_close(out_whole, hf_delta_rule(whole)[0], **TOL)


def _tokens(batch: Batch, tokens: slice) -> dict:
    return {name: getattr(batch, name)[tokens] for name in ("q", "k", "v", "g", "beta")}


# ---------------------------------------------------------------------------- convolution


def make_conv(channels=20, taps=4, lengths=(1, 2, 1, 9, 2), slots=(3, 0, 5, 1, 6),
              initial=(True, False, False, True, True), seed: int = 0):
    """(x, weight, bias, conv_state with NaN in fresh slots, qsl, state_index, init): rows
    shorter than taps - 1, fresh and continuing."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    bias = torch.randn(channels, generator=gen)
    conv_state = garbage_slots((NUM_SLOTS, channels, taps - 1), slots, initial, seed + 1)
    return (x, weight, bias, conv_state, *layout(lengths, slots, initial))


def hf_conv(x, weight, bias, conv_state, query_start_loc, state_index, has_initial_state,
            silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' causal_conv1d_update on each row's slice (a zero window for fresh rows,
    whose output is also checked against causal_conv1d_fn) -> (out, conv_state after)."""
    state = conv_state.clone()
    out = torch.zeros(x.shape)
    starts = query_start_loc.tolist()
    act = "silu" if silu else None
    for r, (slot, init) in enumerate(zip(state_index.tolist(), has_initial_state.tolist())):
        rows = slice(starts[r], starts[r + 1])
        if rows.start == rows.stop:
            continue
        window = state[slot:slot + 1].clone() if init else torch.zeros_like(state[:1])
        row_in = x[rows].t()[None]
        o = hf.causal_conv1d_update(row_in, window, weight, bias, activation=act)
        if not init:
            torch.testing.assert_close(o, hf.causal_conv1d_fn(row_in, weight, bias, act), **TOL)
        out[rows], state[slot] = o[0].t(), window[0]
    return out, state


def check_conv(fn, silu: bool = True, with_bias: bool = True, **shape) -> None:
    """`fn(*conv args, activation_silu=...)` against `hf_conv`; other slots untouched."""
    x, weight, bias, conv_state, qsl, idx, init = make_conv(**shape)
    bias = bias if with_bias else None
    ref_out, ref_state = hf_conv(x, weight, bias, conv_state, qsl, idx, init, silu)
    state = conv_state.clone()
    out = fn(x, weight, bias, state, qsl, idx, init, activation_silu=silu)
    torch.testing.assert_close(out, ref_out, **TOL)
    used = idx.long()
    torch.testing.assert_close(state[used], ref_state[used], equal_nan=True, **TOL)
    others = [s for s in range(NUM_SLOTS) if s not in used.tolist()]
    assert torch.equal(state[others], conv_state[others])


def hf_gating(a, b, A_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3NextGatedDeltaNet.forward's gating."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid().float()


def gating_inputs(tokens: int = 7, heads: int = 4, seed: int = 0):
    """Strided a and b (columns of one projection, as the model splits them), a spanning
    softplus's threshold."""
    gen = torch.Generator().manual_seed(seed)
    ba = torch.randn(tokens, 2 * heads, generator=gen) * 12
    return ba[:, :heads], ba[:, heads:], torch.randn(heads, generator=gen), \
        torch.randn(heads, generator=gen)


# ---------------------------------------------------------------------------- the torch path


@pytest.mark.parametrize("heads,dims", [((2, 4), (8, 12)), ((3, 3), (16, 8))])
@pytest.mark.parametrize("form", ["auto", "recurrent", "chunked"])
@torch.no_grad()
def test_torch_delta_rule_matches_transformers(heads, dims, form) -> None:
    batch = make_batch(heads, dims, seed=len(form))
    state = batch.state.clone()
    out = gdr.gated_delta_rule_torch(*replace(batch, state=state).args, form=form)
    check_delta_rule(batch, out, state)


@torch.no_grad()
def test_torch_prefill_split_across_calls() -> None:
    def run(batch: Batch):
        return gdr.gated_delta_rule_torch(*batch.args), batch.state

    check_split_prefill(run)


@torch.no_grad()
def test_torch_zero_length_row_touches_nothing() -> None:
    batch = make_batch(lengths=(2, 0, 1), slots=(1, 7, 2), initial=(False, True, True))
    state = batch.state.clone()
    out = gdr.gated_delta_rule_torch(*replace(batch, state=state).args,
                                     query_start_loc_np=batch.query_start_loc.numpy())
    check_delta_rule(batch, out, state)  # slot 7 (the empty row's) unchanged


@pytest.mark.parametrize("silu,with_bias", [(True, True), (False, False)])
@torch.no_grad()
def test_torch_conv_matches_transformers(silu, with_bias) -> None:
    check_conv(gdr.causal_conv1d_torch, silu, with_bias)
    check_conv(gdr.causal_conv1d_torch, silu, with_bias, lengths=(1, 0, 70, 3, 1))


@torch.no_grad()
def test_torch_gating_matches_transformers() -> None:
    args = gating_inputs()
    for got, want in zip(gdr.gdn_gating_torch(*args), hf_gating(*args)):
        torch.testing.assert_close(got, want, **TOL)


@torch.no_grad()
def test_bfloat16_runs_the_torch_path() -> None:
    """Not float32 on the CPU: the torch path, output in v's dtype, float32 state."""
    batch = make_batch(lengths=(1, 6), slots=(0, 1), initial=(True, False))
    ref_state = batch.state.clone()
    ref = gdr.gated_delta_rule(*replace(batch, state=ref_state).args)
    half = replace(batch, q=batch.q.bfloat16(), k=batch.k.bfloat16(), v=batch.v.bfloat16(),
                   state=batch.state.clone())
    out = gdr.gated_delta_rule(*half.args)
    assert out.dtype == torch.bfloat16 and half.state.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(half.state[:2], ref_state[:2], rtol=5e-2, atol=5e-2)


@torch.no_grad()
def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 CPU tensors run the numba twin, others the torch path; forced CPU too."""
    calls = []

    def spy(name: str):
        real = getattr(gated_delta_rule_numba, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapper

    for name in ("gated_delta_rule", "causal_conv1d", "gdn_gating"):
        monkeypatch.setattr(gated_delta_rule_numba, name, spy(name))
    batch = make_batch(lengths=(1, 2), slots=(0, 1), initial=(True, False))
    with platform.forced_impl(platform.CPU):
        gdr.gated_delta_rule(*batch.args)
    gdr.causal_conv1d(*make_conv(lengths=(1, 2), slots=(0, 1), initial=(True, False)))
    gdr.gdn_gating(*gating_inputs())
    assert calls == ["gated_delta_rule", "causal_conv1d", "gdn_gating"]
    gdr.gdn_gating(*(t.double() for t in gating_inputs()))
    assert len(calls) == 3
