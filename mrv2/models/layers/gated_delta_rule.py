"""The kernels of the linear-attention layers of Qwen3-Next / Qwen3.5 (Gated DeltaNet): the
gating, the short causal depthwise convolution, and the gated delta rule, over the engine's
flattened varlen batch with per-request state kept in persistent per-slot tensors.

Reference semantics: transformers' qwen3_next `causal_conv1d_update` / `causal_conv1d_fn`,
`l2norm`, `torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule` and the gating of
`Qwen3NextGatedDeltaNet.forward`.

Batch layout: T tokens in B rows; row r owns tokens [query_start_loc[r], query_start_loc[r+1])
and the state slot `state_index[r]`. `has_initial_state[r]` False means the request starts
from scratch: its slot is read as zeros (a reused slot holds stale data) and overwritten.
A row of length 0 (graph padding) reads and writes nothing. Rows never share a slot.
State tensors (float32, updated in place):
- conv_state [num_slots, conv_dim, K - 1]: the last K - 1 convolution inputs, oldest first.
- state [num_slots, Hv, Dk, Dv]: the delta rule's memory (transformers' layout).

Grouped heads: with Hk < Hv key heads, q/k head h // (Hv // Hk) serves value head h (each
q/k head serves Hv // Hk consecutive value heads, transformers' repeat_interleave).

Dispatch (`platform.kernel_impl`): CUDA tensors run the Triton twin
(gated_delta_rule_triton.py, imported on first use), float32 CPU tensors the numba twin
(gated_delta_rule_numba.py), anything else the torch functions below, which are also the
references of the tests. The torch path reads the row lengths on the host (from
`query_start_loc_np` when given); the Triton path never does (CUDA-graph safe).

Numerics: everything is computed in float32; outputs are rounded once to the input dtype
(transformers computes the convolution in the weight's dtype and its SiLU in the input's, so
16-bit outputs may differ by one ulp; its beta is `sigmoid(b)` in b's dtype, ours in float32).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mrv2 import platform
from mrv2.models.layers import gated_delta_rule_numba

CHUNK_SIZE = 64  # tokens per chunk of the torch chunked form (transformers' default)
L2NORM_EPS = 1e-6  # q/k l2-normalisation inside the kernel (FLA's and transformers' value)


def _impl(*tensors: torch.Tensor) -> str:
    """"triton", "numba" (float32 CPU tensors) or "torch"."""
    if platform.kernel_impl(tensors[0].device, portable_cpu_impl=True) == platform.TRITON:
        return "triton"
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return "numba"
    return "torch"


def _host_starts(query_start_loc: torch.Tensor, query_start_loc_np: np.ndarray | None
                 ) -> np.ndarray:
    """The row starts on the host (int64): the given copy, else read from the tensor."""
    if query_start_loc_np is None:
        query_start_loc_np = query_start_loc.cpu().numpy()
    return np.asarray(query_start_loc_np, dtype=np.int64)


# ---------------------------------------------------------------------------- gating


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv], A_log, dt_bias [Hv] -> (g, beta), float32 [T, Hv] each:
    g = -exp(A_log) * softplus(a + dt_bias) (the log of the per-token state decay, <= 0) and
    beta = sigmoid(b) (the write strength)."""
    impl = _impl(a, b, A_log, dt_bias)
    if impl == "triton":
        from mrv2.models.layers import gated_delta_rule_triton  # Triton on first use only

        return gated_delta_rule_triton.gdn_gating(a, b, A_log, dt_bias)
    if impl == "numba":
        return gated_delta_rule_numba.gdn_gating(a, b, A_log, dt_bias)
    return gdn_gating_torch(a, b, A_log, dt_bias)


def gdn_gating_torch(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of `gdn_gating` (any device)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


# ---------------------------------------------------------------------------- convolution


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                  state_index: torch.Tensor, has_initial_state: torch.Tensor, *,
                  query_start_loc_np: np.ndarray | None = None,
                  activation_silu: bool = True) -> torch.Tensor:
    """x [T, C] -> out [T, C] in x's dtype: each row's causal depthwise convolution
    (weight [C, K], optional bias [C], then SiLU when `activation_silu`), continuing from the
    row's window in conv_state [slots, C, K - 1] (zeros when not has_initial_state).

    conv_state[state_index[r]] becomes the row's last K - 1 inputs: a row shorter than K - 1
    shifts its tokens in after the prior window."""
    tensors = (x, weight, conv_state) + (() if bias is None else (bias,))
    impl = _impl(*tensors)
    if impl == "triton":
        from mrv2.models.layers import gated_delta_rule_triton

        return gated_delta_rule_triton.causal_conv1d(
            x, weight, bias, conv_state, query_start_loc, state_index, has_initial_state,
            activation_silu)
    if impl == "numba":
        starts = query_start_loc.numpy() if query_start_loc_np is None else query_start_loc_np
        return gated_delta_rule_numba.causal_conv1d(
            x, weight, bias, conv_state, starts, state_index, has_initial_state,
            activation_silu)
    return causal_conv1d_torch(x, weight, bias, conv_state, query_start_loc, state_index,
                               has_initial_state, activation_silu=activation_silu)


def causal_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                        state_index: torch.Tensor, has_initial_state: torch.Tensor, *,
                        activation_silu: bool = True) -> torch.Tensor:
    """The torch form of `causal_conv1d` (any device, no host reads): every token gathers its
    K inputs from one table holding the batch's tokens followed by each row's prior window."""
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    rows = state_index.shape[0]
    starts = query_start_loc.long()
    lengths = starts[1:] - starts[:-1]
    slots = state_index.long()
    stored = conv_state[slots]
    prior = torch.where(has_initial_state.view(-1, 1, 1), stored.float(), 0.0)
    table = torch.cat([x.float(), prior.transpose(1, 2).reshape(rows * width, channels)])

    def table_index(row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # Position pos of `row` (pos >= -width): a token of the row, or its prior window.
        return torch.where(pos >= 0, starts[row] + pos, num_tokens + row * width + width + pos)

    tokens = torch.arange(num_tokens, device=x.device)
    token_row = torch.searchsorted(starts[1:], tokens, right=True)
    taps = torch.arange(-width, 1, device=x.device)
    window = table[table_index(token_row[:, None], (tokens - starts[token_row])[:, None] + taps)]
    out = (window * weight.float().t()).sum(1)  # [T, K, C] -> [T, C]
    if bias is not None:
        out = out + bias.float()
    if activation_silu:
        out = F.silu(out)
    row_ids = torch.arange(rows, device=x.device)[:, None]
    last = table[table_index(row_ids, lengths[:, None] - width
                             + torch.arange(width, device=x.device))]  # [B, K - 1, C]
    new = torch.where((lengths > 0).view(-1, 1, 1), last.transpose(1, 2), stored.float())
    conv_state.index_copy_(0, slots, new.to(conv_state.dtype))
    return out.to(x.dtype)


# ---------------------------------------------------------------------------- delta rule


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                     state_index: torch.Tensor, has_initial_state: torch.Tensor, *,
                     query_start_loc_np: np.ndarray | None = None, use_qk_l2norm: bool = True,
                     scale: float | None = None) -> torch.Tensor:
    """The gated delta rule over the varlen batch: q, k [T, Hk, Dk], v [T, Hv, Dv],
    g, beta [T, Hv] (`gdn_gating`) -> out [T, Hv, Dv] in v's dtype, `state`
    [slots, Hv, Dk, Dv] updated in place. Per token and value head, with q and k
    l2-normalised (when `use_qk_l2norm`) and q scaled by `scale` (default Dk ** -0.5):
    S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q.

    Algorithms: Triton, one fused recurrent program per (row, value head, Dv block) for every
    row; numba, a fused recurrent pass per (row, value head) (see its module);
    torch, the recurrent form for rows of one token and the chunked form for longer rows."""
    impl = _impl(q, k, v, g, beta, state)
    if impl == "triton":
        from mrv2.models.layers import gated_delta_rule_triton

        return gated_delta_rule_triton.gated_delta_rule(
            q, k, v, g, beta, state, query_start_loc, state_index, has_initial_state,
            use_qk_l2norm, scale)
    if impl == "numba":
        starts = query_start_loc.numpy() if query_start_loc_np is None else query_start_loc_np
        return gated_delta_rule_numba.gated_delta_rule(
            q, k, v, g, beta, state, starts, state_index, has_initial_state, use_qk_l2norm,
            scale)
    return gated_delta_rule_torch(q, k, v, g, beta, state, query_start_loc, state_index,
                                  has_initial_state, query_start_loc_np=query_start_loc_np,
                                  use_qk_l2norm=use_qk_l2norm, scale=scale)


def gated_delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           query_start_loc: torch.Tensor, state_index: torch.Tensor,
                           has_initial_state: torch.Tensor, *,
                           query_start_loc_np: np.ndarray | None = None,
                           use_qk_l2norm: bool = True, scale: float | None = None,
                           form: str = "auto") -> torch.Tensor:
    """The torch form of `gated_delta_rule` (any device). `form`: "recurrent" (token by token,
    all rows of a step at once), "chunked" (CHUNK_SIZE-token chunks, row by row) or "auto"
    (recurrent for rows of one token, chunked for longer ones)."""
    if form not in ("auto", "recurrent", "chunked"):
        raise ValueError(f"form must be 'auto', 'recurrent' or 'chunked', got {form!r}")
    num_v_heads, head_v_dim = v.shape[1:]
    qf, kf = _normalised_qk(q, k, num_v_heads, use_qk_l2norm, scale)
    vf, gf, bf = v.float(), g.float(), beta.float()
    starts = _host_starts(query_start_loc, query_start_loc_np)
    lengths = starts[1:] - starts[:-1]
    slots = state_index.long()
    memory = torch.where(has_initial_state.view(-1, 1, 1, 1), state[slots].float(), 0.0)
    out = torch.zeros(v.shape[0], num_v_heads, head_v_dim, dtype=torch.float32,
                      device=v.device)
    chunked = (lengths >= 2 if form == "auto" else lengths >= 1 if form == "chunked"
               else np.zeros(lengths.shape, dtype=bool))
    recurrent_rows = np.nonzero(~chunked & (lengths > 0))[0]
    if recurrent_rows.size:
        ids = torch.as_tensor(recurrent_rows, device=v.device)
        memory[ids] = _recurrent_rows(qf, kf, vf, gf, bf, memory[ids], starts[recurrent_rows],
                                      lengths[recurrent_rows], out)
    for r in np.nonzero(chunked)[0]:
        tokens = slice(int(starts[r]), int(starts[r + 1]))
        out[tokens], memory[r] = _chunked_row(qf[tokens], kf[tokens], vf[tokens], gf[tokens],
                                              bf[tokens], memory[r])
    written = torch.as_tensor(np.nonzero(lengths > 0)[0], device=v.device)
    state.index_copy_(0, slots[written], memory[written].to(state.dtype))
    return out.to(v.dtype)


def _normalised_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k in float32, l2-normalised (optionally), q scaled, repeated to one head per value
    head (each q/k head serves num_v_heads // Hk consecutive value heads)."""
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2NORM_EPS)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + L2NORM_EPS)
    qf = qf * (q.shape[-1] ** -0.5 if scale is None else scale)
    group = num_v_heads // q.shape[1]
    if group > 1:
        qf, kf = qf.repeat_interleave(group, dim=1), kf.repeat_interleave(group, dim=1)
    return qf, kf


def _recurrent_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, memory: torch.Tensor, starts: np.ndarray,
                    lengths: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """The recurrent form for a set of rows (memory [R, Hv, Dk, Dv], their starts and
    lengths >= 1 on the host): step s advances every row longer than s. Writes `out` at the
    rows' tokens; returns the rows' final memory."""
    memory = memory.clone()
    for step in range(int(lengths.max())):
        active = np.nonzero(lengths > step)[0]
        ids = torch.as_tensor(active, device=q.device)
        t = torch.as_tensor(starts[active] + step, device=q.device)
        s = memory[ids] * g[t].exp()[..., None, None]
        k_t = k[t]
        predicted = torch.einsum("rhkv,rhk->rhv", s, k_t)
        delta = (v[t] - predicted) * beta[t][..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        out[t] = torch.einsum("rhkv,rhk->rhv", s, q[t])
        memory[ids] = s
    return memory


def _chunked_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form for one row: q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], memory
    [H, Dk, Dv] -> (out [L, H, Dv], final memory).

    Within a chunk of C tokens (positions a, b; G = cumulative g from the chunk start), the
    updates of all its tokens are solved at once: with M = I + strictly-lower((beta k) k^T *
    exp(G_a - G_b)), U = M^-1 (beta v) are the values written relative to a zero memory and
    W = M^-1 (beta k exp(G)) what the memory at the chunk start subtracts from them. Then
    out = (q exp(G)) S + causal(q k^T * exp(G_a - G_b)) (U - W S) and the next chunk starts
    from S exp(G_last) + (k exp(G_last - G))^T (U - W S). Padding tokens (k = v = beta = 0,
    g = 0) change nothing."""
    length, heads, head_k_dim = k.shape
    head_v_dim = v.shape[-1]
    pad = (-length) % CHUNK_SIZE
    chunks = (length + pad) // CHUNK_SIZE

    def by_chunk(x: torch.Tensor) -> torch.Tensor:  # [L, H, D] -> [H, N, C, D]
        return F.pad(x.transpose(0, 1), (0, 0, 0, pad)).reshape(heads, chunks, CHUNK_SIZE, -1)

    q, k, v = by_chunk(q), by_chunk(k), by_chunk(v)
    beta = by_chunk(beta[..., None])
    cum = by_chunk(g[..., None])[..., 0].cumsum(-1)  # [H, N, C]
    causal = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).tril()
    # exp(G_a - G_b) where b <= a; masked before the exp (G_a - G_b > 0 above the diagonal)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: unit triangular
    solved = torch.linalg.solve_triangular(
        system, torch.cat([v * beta, k_beta * cum.exp()[..., None]], -1), upper=False,
        unitriangular=True)
    written, from_memory = solved.split([head_v_dim, head_k_dim], -1)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty(heads, chunks, CHUNK_SIZE, head_v_dim, dtype=torch.float32,
                      device=q.device)
    for n in range(chunks):
        new_values = written[:, n] - from_memory[:, n] @ memory
        out[:, n] = q_decayed[:, n] @ memory + attn[:, n] @ new_values
        memory = memory * chunk_decay[:, n] + k_decayed[:, n].transpose(-1, -2) @ new_values
    return out.reshape(heads, chunks * CHUNK_SIZE, head_v_dim)[:, :length].transpose(0, 1), \
        memory
