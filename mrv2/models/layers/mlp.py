"""The gated MLP block (Llama, Mistral, Qwen, ...): down(act(gate(x)) * up(x)), gate and up one
fused column-parallel projection, down row-parallel.

Two CPU choices live here, beside the block they serve:

- **Row chunks.** A prefill's [T, 2I] gate/up intermediate is far larger than the CPU caches
  and costs page faults and DRAM round trips; batches of more than `chunk_rows` rows run chunk
  by chunk so it stays in the last-level cache (bench/README.md has the measurement).
- **bfloat16 between the projections.** Where both projections compute on bfloat16 weights
  whose plans run the step's rows on the CPU's matrix units (`native_bfloat16_weights`: from
  `linear_plan.MIN_NATIVE_HALF_ROWS` rows), the step keeps gate/up's output and the
  activation in bfloat16 (`activation_numba.silu_and_mul_bf16`) instead of a float32 round
  trip that down would round again. The results are the plain path's bit for bit: the same
  roundings in the same places. Where both plans run the rows on int8 products (a prompt's
  rows, `int8_weights`), the activation is computed in float32 from gate/up's int8 sums and
  rounded straight to down's int8 rows (int8_linear.silu_and_mul_int8_rows).
"""

from __future__ import annotations

import torch
from torch import nn

from mrv2.models.layers import activation_numba, cpu_linear, int8_linear
from mrv2.models.layers.activation import GATED_ACTIVATIONS
from mrv2.models.layers.int8_linear import Int8Weight
from mrv2.models.layers.linear import MergedLinear, RowParallelLinear, bfloat16_weight
from mrv2.models.layers.linear_plan import LinearKernel
from mrv2.models.layers.quantized import PackedWeight

# The size of one chunk's [rows, 2I] float32 intermediate (a fraction of the last-level cache).
CHUNK_BYTES = 8 << 20


def chunk_rows(intermediate_size: int) -> int:
    """Rows per chunk: the gate/up intermediate stays within CHUNK_BYTES."""
    return max(128, CHUNK_BYTES // (8 * intermediate_size))


def native_bfloat16_weights(mlp: GatedMLP, rows: int
                            ) -> tuple[PackedWeight, PackedWeight] | None:
    """(gate/up, down) where both projections' plans run `rows` rows on the CPU's matrix
    units, on bias-free bfloat16 weights (their own, or their blocks' copies); else None."""
    gate_up, down = bfloat16_weight(mlp.gate_up_proj), bfloat16_weight(mlp.down_proj)
    if gate_up is None or down is None or not all(
            m.packed.plan.kernel_for(rows) is LinearKernel.NATIVE_16BIT
            for m in (mlp.gate_up_proj, mlp.down_proj)):
        return None
    return gate_up, down


def native_bfloat16_mlp(x: torch.Tensor, gate_up: PackedWeight,
                        down: PackedWeight) -> torch.Tensor:
    """The MLP of float32 rows `x` on bfloat16 weights, bfloat16 between the projections."""
    hidden = cpu_linear.half_linear(x.to(torch.bfloat16), gate_up.onednn_packed())
    act = activation_numba.silu_and_mul_bf16(hidden)
    return cpu_linear.half_linear(act, down.onednn_packed()).float()


def int8_weights(mlp: GatedMLP, rows: int) -> tuple[Int8Weight, Int8Weight] | None:
    """(gate/up, down)'s int8 copies where both projections' plans run `rows` rows on int8
    products (bias-free); else None."""
    modules = (mlp.gate_up_proj, mlp.down_proj)
    if any(m.bias is not None or not isinstance(getattr(m, "packed", None), PackedWeight)
           or m.packed.plan.kernel_for(rows) is not LinearKernel.INT8_PRODUCTS
           for m in modules):
        return None
    return modules[0].packed.int8_copy, modules[1].packed.int8_copy


def int8_mlp(x: torch.Tensor, gate_up: Int8Weight, down: Int8Weight) -> torch.Tensor:
    """The MLP of float32 rows `x` on int8 products: the activation computed in float32 from
    gate/up's sums and rounded to int8 rows for down in the same pass."""
    qx, sx = int8_linear.int8_rows(x)
    act, act_scales = int8_linear.silu_and_mul_int8_rows(int8_linear.int8_sums(qx, gate_up), sx)
    return int8_linear.scale_rows(int8_linear.int8_sums(act, down), act_scales)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; supported: "
                             f"{', '.join(GATED_ACTIVATIONS)}")
        self.hidden_act = hidden_act
        self.act_and_mul = GATED_ACTIVATIONS[hidden_act]
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.intermediate_size = self.gate_up_proj.output_sizes[0]  # this rank's part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = chunk_rows(self.intermediate_size)
        if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] <= rows:
            return self.forward_rows(x)
        out = x.new_empty(x.shape[0], self.down_proj.output_size)
        for start in range(0, x.shape[0], rows):
            out[start:start + rows] = self.forward_rows(x[start:start + rows])
        return out

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of `x` in one pass (no row chunks)."""
        if (self.hidden_act == "silu" and x.dim() == 2 and x.dtype == torch.float32
                and x.device.type == "cpu" and not torch.is_grad_enabled()):
            weights = native_bfloat16_weights(self, x.shape[0])
            if weights is not None:
                return native_bfloat16_mlp(x, *weights)
            int8 = int8_weights(self, x.shape[0])
            if int8 is not None:
                return int8_mlp(x, *int8)
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
