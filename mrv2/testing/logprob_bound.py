"""A first-order bound on how far a reduced-precision path's logprobs may move from the exact
model's (issue 16): quantized activations, 16-bit weights or a 16-bit KV cache, and float32
arithmetic, on a Llama decoder.

Derivation. Run the model in float64 (exact for this purpose: its rounding is 2^-29 times
float32's) and write every rounding a path makes as an additive error e_i on one tensor y_i (an
operation's output, a weight, a linear's input), bounded elementwise by |e_i| <= b_i, where b_i
follows from that rounding's own error analysis (below). To first order in the e_i, a logprob
moves by sum_i <d logprob / d y_i, e_i>, so

    |logprob_path - logprob_exact| <= sum_i <|d logprob / d y_i|, b_i>   (+ second order)

and the gradient of one logprob with respect to every tap is one backward pass. The bound is
exact to first order for the b_i given (each e_i may take any sign), not a statistical estimate;
the second-order terms are products of two relative roundings (2^-16 for bfloat16) and are
left out. A rounding is tapped where it happens, so that one error shared by many outputs is one
e_i: a 16-bit weight is rounded once for every position (the tap is on the weight; a tied LM
head shares the embedding's), and an integer input once for every linear reading it (q, k and v;
gate and up). Bounds (u = 2^-24, gamma(n) = n u / (1 - n u), the classic bound on an n-term
float32 sum, |x| and |W| elementwise absolute values):

- 16-bit weights (`Rounding.weight_unit_roundoff` u_w): u_w |W| on every weight and embedding;
- integer activations: x rounded per 32-input block g to steps d_g = max |x_g| / L (L = 127 for
  int8, 32767 for int16), each input moving at most d_g / 2 (the integer products are exact);
- a 16-bit KV cache: u_kv |k| and u_kv |v| at the cached (rotated) keys and values;
- float32 arithmetic, on every path: a linear y = x W^T of K inputs gamma(K + 4) |x| |W'|^T,
  where W' is |W| for float weights and, for weights from GGUF blocks, twice the block's largest
  |w| (a kernel on blocks sums d q and m separately; |d q|, |m| <= 2 max |w| in every block
  type, and the dequantized float32 weight itself is one rounding off); RMSNorm
  gamma(H + 4) |y|; rotary gamma(3) (|q| |cos| + |rot q| |sin|) plus the angle's rounding;
  attention scores gamma(D + 2) |q| |k|^T s; softmax (gamma(T + 4) + u |s - max|) p; attention
  values gamma(T + 2) p |v|; SiLU-and-multiply (gamma(6) + u |g|) |y|; each residual add u |h|;
  log-softmax gamma(V + 4) (|z| + |lse|).

`logprob_bounds` returns, per target (position, token), the exact logprob and, for each rounding,
its bound; tests/testing/test_logprob_bound.py checks mrv2's paths against it,
bench/logprob_bound.py reports it on the built-in model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from mrv2.models.layers.quantized_int8_numba import INT8_BLOCK  # inputs sharing an x scale

U32 = 2.0 ** -24
BFLOAT16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significand bits, round to nearest
FLOAT16_UNIT_ROUNDOFF = 2.0 ** -11


def gamma(n: int) -> float:
    """The bound n u / (1 - n u) on the relative error of an n-term float32 sum."""
    return n * U32 / (1 - n * U32)


@dataclass(frozen=True)
class Rounding:
    """The roundings a path makes beyond float32 arithmetic (all 0 / False: a float32 path)."""

    # Unit roundoff of the linears', embedding's and LM head's weights as kept (bfloat16: 2^-8).
    weight_unit_roundoff: float = 0.0
    # The levels L each linear's input is rounded to per 32-input block (127: int8, 32767:
    # int16; 0: x stays float32).
    activation_levels: int = 0
    # Unit roundoff of the cached keys and values.
    kv_unit_roundoff: float = 0.0
    # Whether the weights come from GGUF blocks (see the module docstring's linear rule).
    weights_in_blocks: bool = False


@dataclass(frozen=True)
class LogprobBounds:
    """For one rounding, per target: `bound`, the first-order worst case (every error at its
    bound, each sign against you), and `rms`, the root mean square of the first-order error if
    each rounding error were independent and uniform on [-b, b]: the typical size, not a bound."""

    bound: torch.Tensor  # [targets] float64
    rms: torch.Tensor  # [targets] float64


class _Taps:
    """Additive error points: each tap adds a zero leaf whose gradient is d out / d y, and
    keeps one bound on its error per rounding (a float32 floor plus the rounding's own)."""

    def __init__(self, roundings: tuple[Rounding, ...]) -> None:
        self.roundings = roundings
        self.deltas: list[torch.Tensor] = []
        self.bounds: list[list[torch.Tensor]] = []  # [tap][rounding]

    def __call__(self, y: torch.Tensor, floor: torch.Tensor | float,
                 own: Callable[[Rounding], torch.Tensor | float] = lambda r: 0.0
                 ) -> torch.Tensor:
        bounds = [torch.as_tensor(floor + own(r), dtype=y.dtype).detach().expand_as(y)
                  for r in self.roundings]
        if not any(bool(b.any()) for b in bounds):
            return y
        delta = torch.zeros_like(y, requires_grad=True)
        self.deltas.append(delta)
        self.bounds.append(bounds)
        return y + delta


def _block_weight_abs(w: torch.Tensor) -> torch.Tensor:
    """|W'| of the linear rule for weights from GGUF blocks: twice each block's largest |w|."""
    n, k = w.shape
    return (2 * w.abs().reshape(n, k // INT8_BLOCK, INT8_BLOCK).amax(-1, keepdim=True)
            ).expand(n, k // INT8_BLOCK, INT8_BLOCK).reshape(n, k)


def _integer_step(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Half of each input's integer step: max |x_g| / levels / 2 over its 32-input block g."""
    t, k = x.shape
    if k % INT8_BLOCK:
        raise ValueError(f"{k} inputs are not whole blocks of {INT8_BLOCK}")
    step = x.abs().reshape(t, k // INT8_BLOCK, INT8_BLOCK).amax(-1, keepdim=True) / (2 * levels)
    return step.expand(t, k // INT8_BLOCK, INT8_BLOCK).reshape(t, k)


class _Model:
    """A float64 Llama decoder over an HF state dict, every rounding point tapped."""

    def __init__(self, config, state: dict[str, torch.Tensor], taps: _Taps) -> None:
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rope['rope_type']!r}: only default rotary")
        self.theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        self.layers = config.num_hidden_layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.w = {name: t.double() for name, t in state.items()}
        tied = "lm_head.weight" not in self.w or getattr(config, "tie_word_embeddings", False)
        self.aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
        self.taps = taps
        self.tapped: dict[str, torch.Tensor] = {}

    def weight(self, name: str) -> torch.Tensor:
        """The weight as the path keeps it: one tap per tensor (a tied LM head shares the
        embedding's), as every position reads the same rounded weight."""
        name = self.aliases.get(name, name)
        if name not in self.tapped:
            w = self.w[name]
            self.tapped[name] = self.taps(w, 0.0, lambda r: r.weight_unit_roundoff * w.abs())
        return self.tapped[name]

    def linear_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the linears reading it see it: rounded to int8 per block on that path (one tap
        for every linear sharing x: each rounds it alike)."""
        return self.taps(x, 0.0, lambda r: _integer_step(x.detach(), r.activation_levels)
                         if r.activation_levels else 0.0)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.w[self.aliases.get(name, name)]
        ax = x.detach().abs()
        in_blocks = w.shape[1] % INT8_BLOCK == 0

        def floor(r: Rounding) -> torch.Tensor:
            w_abs = _block_weight_abs(w) if r.weights_in_blocks and in_blocks else w.abs()
            return gamma(w.shape[1] + 4) * (ax @ w_abs.T)

        return self.taps(x @ self.weight(name).T, 0.0, floor)

    def norm(self, h: torch.Tensor, name: str) -> torch.Tensor:
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]
        return self.taps(y, gamma(h.shape[-1] + 4) * y.detach().abs())

    def rotary_tables(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] of positions 0..t-1, and their float32 error: the angle is
        gamma(2) |angle| off, each of cos and sin 1 ulp."""
        half = self.head_dim // 2
        inv_freq = self.theta ** -(torch.arange(half, dtype=torch.float64) / half)
        angle = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq  # [T, half]
        cos = torch.cat([angle.cos()] * 2, -1)[:, None]
        sin = torch.cat([angle.sin()] * 2, -1)[:, None]
        trig = gamma(2) * torch.cat([angle.abs()] * 2, -1)[:, None] + 2 * U32
        return cos, sin, trig

    def rotary(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
               ) -> torch.Tensor:
        cos, sin, trig = tables
        half = self.head_dim // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        y = x * cos + rot * sin
        ax, ar = x.detach().abs(), rot.detach().abs()
        return self.taps(y, gamma(3) * (ax * cos.abs() + ar * sin.abs()) + trig * (ax + ar))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, d = q.shape[0], self.head_dim
        group = self.heads // self.kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scale = 1 / math.sqrt(d)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        abs_scores = torch.einsum("qhd,khd->hqk", q.detach().abs(), k.detach().abs()) * scale
        scores = self.taps(scores, gamma(d + 2) * abs_scores)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        p = torch.softmax(scores, -1)
        spread = (scores.detach() - scores.detach().amax(-1, keepdim=True)).abs()
        p = self.taps(p, (gamma(t + 4) + U32 * spread.nan_to_num(posinf=0.0)) * p.detach())
        out = torch.einsum("hqk,khd->qhd", p, v)
        abs_out = torch.einsum("hqk,khd->qhd", p.detach(), v.detach().abs())
        return self.taps(out, gamma(t + 2) * abs_out).reshape(t, self.heads * d)

    def logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        taps, d, t = self.taps, self.head_dim, ids.shape[0]
        tables = self.rotary_tables(t)
        h = self.weight("model.embed_tokens.weight")[ids]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            x = self.linear_input(self.norm(h, p + "input_layernorm.weight"))
            q = self.linear(x, p + "self_attn.q_proj.weight").reshape(t, self.heads, d)
            k = self.linear(x, p + "self_attn.k_proj.weight").reshape(t, self.kv_heads, d)
            v = self.linear(x, p + "self_attn.v_proj.weight").reshape(t, self.kv_heads, d)
            q, k = self.rotary(q, tables), self.rotary(k, tables)
            k_abs, v_abs = k.detach().abs(), v.detach().abs()
            k = taps(k, 0.0, lambda r: r.kv_unit_roundoff * k_abs)
            v = taps(v, 0.0, lambda r: r.kv_unit_roundoff * v_abs)
            o = self.linear_input(self.attention(q, k, v))
            h = h + self.linear(o, p + "self_attn.o_proj.weight")
            h = taps(h, U32 * h.detach().abs())
            x = self.linear_input(self.norm(h, p + "post_attention_layernorm.weight"))
            g = self.linear(x, p + "mlp.gate_proj.weight")
            y = torch.nn.functional.silu(g) * self.linear(x, p + "mlp.up_proj.weight")
            y = taps(y, (gamma(6) + U32 * g.detach().abs()) * y.detach().abs())
            h = h + self.linear(self.linear_input(y), p + "mlp.down_proj.weight")
            h = taps(h, U32 * h.detach().abs())
        z = self.linear(self.linear_input(self.norm(h, "model.norm.weight")), "lm_head.weight")
        lse = torch.logsumexp(z, -1, keepdim=True)
        return taps(z - lse, gamma(z.shape[-1] + 4) * (z.detach().abs() + lse.detach().abs()))


def logprob_bounds(config, state: dict[str, torch.Tensor], token_ids: list[int],
                   targets: list[tuple[int, int]], roundings: tuple[Rounding, ...]
                   ) -> tuple[torch.Tensor, list[LogprobBounds]]:
    """The exact logprob of each target (position p, token j): log P(token j | token_ids[:p+1])
    under the float64 model of `state` (an HF Llama state dict, `config` its HF config), and per
    rounding the first-order bounds on a path's error in each (see the module docstring): one
    backward pass per target serves every rounding. Returns (exact [targets], bounds per
    rounding)."""
    taps = _Taps(tuple(roundings))
    model = _Model(config, state, taps)
    with torch.enable_grad():
        logprobs = model.logprobs(torch.tensor(token_ids))
        exact = []
        worst = [[] for _ in roundings]
        squares = [[] for _ in roundings]
        for position, token in targets:
            target = logprobs[position, token]
            grads = torch.autograd.grad(target, taps.deltas, retain_graph=True,
                                        allow_unused=True)
            for i in range(len(roundings)):
                terms = [g.abs() * b[i] for g, b in zip(grads, taps.bounds) if g is not None]
                worst[i].append(sum(float(t.sum()) for t in terms))
                squares[i].append(sum(float(t.pow(2).sum()) for t in terms) / 3)
            exact.append(float(target.detach()))
    as64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return as64(exact), [LogprobBounds(as64(w), as64(q).sqrt()) for w, q in zip(worst, squares)]
