"""Linear layers whose weights the loader fills from Hugging Face checkpoints.

Parameters are allocated with `torch.empty` (no random init: every value is overwritten by
the loader, and random init of a multi-GB model is slow on CPU). Each parameter carries:

- `weight_loader(param, loaded, shard_id=None)`: copies one checkpoint tensor into the
  parameter, converting dtype and device;
- `shard_ids`: the shards that must all be loaded before the parameter counts as loaded
  (`(None,)` for an unfused parameter).

Fused layers (`QKVLinear`, `MergedLinear`) store several checkpoint tensors stacked along the
output dimension. The output-dim offset of each shard is computed in one place
(`shard_range`) so that tensor parallelism can later narrow both the shard and the loaded
tensor to this rank's part without touching callers.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

ShardId = Hashable


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor,
                          shard_id: ShardId = None) -> None:
    """Copy a whole tensor into `param` (dtype/device converted by `copy_`)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not fused: "
                         f"got shard {shard_id!r}")
    _check_shape(param, loaded, "weight")
    with torch.no_grad():
        param.copy_(loaded)


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


class Linear(nn.Module):
    """y = x W^T (+ b), W: [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader, shard_ids=(None,))
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(output_size),
                                                          requires_grad=False)
            set_weight_attrs(self.bias, weight_loader=default_weight_loader, shard_ids=(None,))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class _FusedLinear(Linear):
    """A Linear whose output rows are the concatenation of named shards."""

    def __init__(self, input_size: int, shard_sizes: dict[ShardId, int],
                 bias: bool = False) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        # Insertion order of shard_sizes is the row order in the fused weight.
        self.shard_sizes = dict(shard_sizes)
        shard_ids = tuple(self.shard_sizes)
        for param in self.parameters(recurse=False):
            set_weight_attrs(param, weight_loader=self.weight_loader, shard_ids=shard_ids)

    def shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        """(offset, size) of `shard_id` along the output dimension of the fused parameter."""
        if shard_id not in self.shard_sizes:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of "
                             f"{list(self.shard_sizes)}")
        offset = 0
        for sid, size in self.shard_sizes.items():
            if sid == shard_id:
                return offset, size
            offset += size
        raise AssertionError("unreachable")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        if shard_id is None:
            # A checkpoint that already stores the fused tensor.
            default_weight_loader(param, loaded)
            return
        offset, size = self.shard_range(shard_id)
        # Output dim is dim 0 for both weight [out, in] and bias [out].
        target = param.narrow(0, offset, size)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"shard {shard_id!r}: checkpoint tensor has shape "
                             f"{tuple(loaded.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(loaded)


class QKVLinear(_FusedLinear):
    """Fused q/k/v projection: weight [(H + 2*KV) * D, hidden], rows ordered q, k, v."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        super().__init__(hidden_size, {"q": num_heads * head_dim,
                                       "k": num_kv_heads * head_dim,
                                       "v": num_kv_heads * head_dim}, bias)
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H*D], k [T, KV*D], v [T, KV*D] (views of one matmul)."""
        qkv = self.forward(x)
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class MergedLinear(_FusedLinear):
    """Several projections of the same input stacked along the output dim (e.g. gate_up:
    shard 0 = gate_proj, shard 1 = up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, {i: size for i, size in enumerate(output_sizes)}, bias)
        self.output_sizes = list(output_sizes)
