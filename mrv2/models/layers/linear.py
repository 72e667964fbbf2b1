"""Linear layers whose weights the loader fills from Hugging Face checkpoints, sharded for
tensor parallelism.

Parameters are allocated with `torch.empty` (no random init: every value is overwritten by
the loader, and random init of a multi-GB model is slow on CPU). Each parameter carries:

- `weight_loader(param, loaded, shard_id=None)`: copies this rank's part of one checkpoint
  tensor into the parameter, converting dtype and device. `loaded` is a torch tensor or a
  lazy safetensors slice (`safe_open(...).get_slice(name)`): a rank then reads only its rows
  or columns from the file;
- `shard_ids`: the shards that must all be loaded before the parameter counts as loaded
  (`(None,)` for an unfused parameter).

Tensor parallelism (Megatron style), rank r of tp:
- column-parallel (`ColumnParallelLinear`, fused `QKVLinear` / `MergedLinear`): each rank holds
  1/tp of the output rows *of every shard* (its q heads, its kv heads, its part of gate and of
  up), so a rank's output splits exactly like the unsharded one;
- row-parallel (`RowParallelLinear`: o_proj, down_proj): each rank holds 1/tp of the input
  columns; the partial products are summed with all_reduce and the bias is added once, after;
- the vocabulary-parallel embedding and LM head live in `vocab_embedding.py`.

The rank and size default to `mrv2.distributed` (set when a worker joins the group) and may be
passed explicitly (unit tests shard without processes). With tp=1 every layer computes exactly
what the unsharded layer did.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch import nn

from mrv2 import distributed
from mrv2.models.layers import cpu_linear
from mrv2.models.layers.quantized import PackedWeight, quantized_linear

ShardId = Hashable


# -- checkpoint tensors: torch tensors or lazy safetensors slices ---------------------------------

def tensor_shape(loaded: Any) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())  # safetensors PySafeSlice


def narrow(loaded: Any, dim: int, start: int, size: int) -> Any:
    """Rows/columns [start, start + size) of `loaded` along `dim`; a lazy slice stays lazy."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return _LazyNarrow(loaded, dim, start, size)


def materialize(loaded: Any) -> torch.Tensor:
    """A torch tensor; a lazy slice reads only its selected part from the file here."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    if isinstance(loaded, _LazyNarrow):
        return loaded.read()
    shape = tensor_shape(loaded)
    return loaded[tuple(slice(None) for _ in shape)] if shape else loaded[...]


class _LazyNarrow:
    """A narrowed view of a safetensors slice, read on `materialize` (one narrow at a time is
    all the loaders need)."""

    def __init__(self, base: Any, dim: int, start: int, size: int) -> None:
        shape = tensor_shape(base)
        dim = dim % len(shape)
        self.base, self.dim, self.start, self.size = base, dim, start, size
        self.shape = shape[:dim] + (size,) + shape[dim + 1:]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def read(self) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[self.dim] = slice(self.start, self.start + self.size)
        return self.base[tuple(index)]


def tp_rank_and_size(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    rank = distributed.get_tp_rank() if tp_rank is None else tp_rank
    size = distributed.get_tp_size() if tp_size is None else tp_size
    if not 0 <= rank < size:
        raise ValueError(f"tp_rank={rank} is outside tp_size={size}")
    return rank, size


def _check_shape(param: nn.Parameter, loaded: Any, what: str) -> None:
    if tuple(param.shape) != tensor_shape(loaded):
        raise ValueError(f"{what}: checkpoint tensor has shape {tensor_shape(loaded)}, "
                         f"expected {tuple(param.shape)}")


def _copy(target: torch.Tensor, loaded: Any) -> None:
    with torch.no_grad():
        target.copy_(materialize(loaded))


def check_unfused(param: nn.Parameter, shard_id: ShardId) -> None:
    """A parameter that is not fused takes whole tensors only (shard None)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not fused: "
                         f"got shard {shard_id!r}")


def default_weight_loader(param: nn.Parameter, loaded: Any,
                          shard_id: ShardId = None) -> None:
    """Copy a whole tensor into `param` (dtype/device converted by `copy_`); replicated
    parameters (norms, row-parallel biases) use it on every rank."""
    check_unfused(param, shard_id)
    _check_shape(param, loaded, "weight")
    _copy(param, loaded)


def packed_linear(x: torch.Tensor, weight: PackedWeight,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ `weight` (GGUF blocks or a 16-bit weight)^T (+ bias) -> [..., N]."""
    shape = x.shape
    out = quantized_linear(x.reshape(-1, shape[-1]), weight, bias)
    return out.reshape(*shape[:-1], out.shape[-1])


def set_packed(module: nn.Module, weight: PackedWeight) -> None:
    """Make `module` (a linear, embedding or LM head on one rank) compute on `weight` from now
    on: `module.packed` is read by its forward, and the float weight the loader wrote is
    released (nothing reads it again)."""
    module.packed = weight
    module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)


def bfloat16_weight(module: nn.Module) -> PackedWeight | None:
    """The bfloat16 weight a bias-free projection computes on at many rows (`module.packed`,
    or the bfloat16 copy that weight holds), or None: what the matrix-unit paths
    (layers.mlp, models/cpu/onednn_decode) compute on, from the rows `module.packed.plan`
    gives NATIVE_16BIT."""
    packed = module.packed
    if module.bias is not None or not isinstance(packed, PackedWeight):
        return None
    half = packed.many_rows_half
    return half if half.is_half and half.half_dtype == torch.bfloat16 else None


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


def register_replicated_bias(module: nn.Module, size: int, bias: bool) -> None:
    """`module.bias`: a [size] parameter every rank loads whole, or None without a bias."""
    if bias:
        module.bias = nn.Parameter(torch.empty(size), requires_grad=False)
        set_weight_attrs(module.bias, weight_loader=default_weight_loader, shard_ids=(None,))
    else:
        module.register_parameter("bias", None)


class Linear(nn.Module):
    """y = x W^T (+ b), W: [output_size, input_size]; replicated on every rank.

    `packed`: None while the layer computes on `weight`; the GGUF blocks or 16-bit weight it
    computes on instead once the loader gave it one (`set_packed`, one rank only)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader, shard_ids=(None,))
        register_replicated_bias(self, output_size, bias)
        self.packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return cpu_linear.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnParallelLinear(Linear):
    """Output rows split over the ranks: rank r holds rows [r*O/tp, (r+1)*O/tp) of W and b.

    `input_size`/`output_size` are the full (checkpoint) sizes; `output_size_per_partition` is
    what this rank computes. No communication: the output stays split."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        per_rank = distributed.divide(output_size, self.tp_size, "output_size")
        super().__init__(input_size, per_rank, bias)
        self.output_size = output_size
        self.output_size_per_partition = per_rank
        for param in self.parameters(recurse=False):
            set_weight_attrs(param, weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: ShardId = None) -> None:
        check_unfused(param, shard_id)
        full = (self.output_size, *param.shape[1:])
        if tensor_shape(loaded) != full:
            raise ValueError(f"weight: checkpoint tensor has shape {tensor_shape(loaded)}, "
                             f"expected {full}")
        per_rank = self.output_size_per_partition
        _copy(param, narrow(loaded, 0, self.tp_rank * per_rank, per_rank))

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size_per_partition} "
                f"(of {self.output_size}, rank {self.tp_rank}/{self.tp_size}), "
                f"bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """Input columns split over the ranks: rank r holds columns [r*I/tp, (r+1)*I/tp) of W and
    takes the matching slice of the input (the output of a column-parallel layer); the partial
    products are summed with all_reduce, then the (replicated) bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = distributed.divide(input_size, self.tp_size,
                                                           "input_size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition),
                                   requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader, shard_ids=(None,))
        register_replicated_bias(self, output_size, bias)
        self.packed: PackedWeight | None = None  # as Linear's

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: ShardId = None) -> None:
        check_unfused(param, shard_id)
        full = (self.output_size, self.input_size)
        if tensor_shape(loaded) != full:
            raise ValueError(f"weight: checkpoint tensor has shape {tensor_shape(loaded)}, "
                             f"expected {full}")
        per_rank = self.input_size_per_partition
        _copy(param, narrow(loaded, 1, self.tp_rank * per_rank, per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if self.tp_size == 1:
            return cpu_linear.linear(x, self.weight, self.bias)
        out = distributed.tp_all_reduce(cpu_linear.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.input_size_per_partition} (of {self.input_size}, rank "
                f"{self.tp_rank}/{self.tp_size}), out={self.output_size}, "
                f"bias={self.bias is not None}")


class _FusedLinear(Linear):
    """A column-parallel Linear whose output rows are the concatenation of named shards.

    `shard_sizes` are the full (checkpoint) sizes; each rank holds 1/tp of every shard, stored
    in the same shard order, so `shard_range` gives this rank's (offset, size) and the loaded
    tensor is narrowed to rows [rank * size, (rank + 1) * size)."""

    def __init__(self, input_size: int, shard_sizes: dict[ShardId, int],
                 bias: bool = False, *, tp_rank: int | None = None,
                 tp_size: int | None = None) -> None:
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        # Insertion order of shard_sizes is the row order in the fused weight.
        self.full_shard_sizes = dict(shard_sizes)
        local = {sid: distributed.divide(size, self.tp_size, f"shard {sid!r} size")
                 for sid, size in shard_sizes.items()}
        super().__init__(input_size, sum(local.values()), bias)
        self.shard_sizes = local
        shard_ids = tuple(self.shard_sizes)
        for param in self.parameters(recurse=False):
            set_weight_attrs(param, weight_loader=self.weight_loader, shard_ids=shard_ids)

    def shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        """(offset, size) of `shard_id` along the output dimension of this rank's parameter."""
        return self._range(self.shard_sizes, shard_id)

    def checkpoint_shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        """(offset, size) of this rank's rows of `shard_id` in the unfused checkpoint tensor."""
        _, size = self.shard_range(shard_id)
        return self.tp_rank * size, size

    @staticmethod
    def _range(sizes: dict[ShardId, int], shard_id: ShardId) -> tuple[int, int]:
        if shard_id not in sizes:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(sizes)}")
        offset = 0
        for sid, size in sizes.items():
            if sid == shard_id:
                return offset, size
            offset += size
        raise AssertionError("unreachable")

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: ShardId = None) -> None:
        if shard_id is None:
            # A checkpoint that already stores the fused tensor (all shards, full sizes).
            if self.tp_size == 1:
                default_weight_loader(param, loaded)
                return
            full = (sum(self.full_shard_sizes.values()), *param.shape[1:])
            if tensor_shape(loaded) != full:
                raise ValueError(f"fused weight: checkpoint tensor has shape "
                                 f"{tensor_shape(loaded)}, expected {full}")
            for sid in self.shard_sizes:
                full_offset, _ = self._range(self.full_shard_sizes, sid)
                start, size = self.checkpoint_shard_range(sid)
                offset, _ = self.shard_range(sid)
                _copy(param.narrow(0, offset, size), narrow(loaded, 0, full_offset + start, size))
            return
        offset, size = self.shard_range(shard_id)
        # Output dim is dim 0 for both weight [out, in] and bias [out].
        full = (self.full_shard_sizes[shard_id], *param.shape[1:])
        if tensor_shape(loaded) != full:
            raise ValueError(f"shard {shard_id!r}: checkpoint tensor has shape "
                             f"{tensor_shape(loaded)}, expected {full}")
        start, _ = self.checkpoint_shard_range(shard_id)
        _copy(param.narrow(0, offset, size), narrow(loaded, 0, start, size))


class QKVLinear(_FusedLinear):
    """Fused q/k/v projection: weight [(H + 2*KV) * D, hidden], rows ordered q, k, v.

    Under tensor parallelism each rank holds H/tp query heads and KV/tp kv heads (the heads
    [r*H/tp, (r+1)*H/tp) and [r*KV/tp, (r+1)*KV/tp)); `num_heads`/`num_kv_heads` are this
    rank's counts.

    `projections`: which of q, k, v the layer computes (Gemma 4: q and k where values are the
    keys, `attention_k_eq_v`; q alone in a layer that reuses another's keys and values)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, *, tp_rank: int | None = None,
                 tp_size: int | None = None, projections: str = "qkv") -> None:
        rank, size = tp_rank_and_size(tp_rank, tp_size)
        local_heads = distributed.divide(num_heads, size, "num_attention_heads")
        local_kv = distributed.divide(num_kv_heads, size, "num_key_value_heads")
        widths = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                  "v": num_kv_heads * head_dim}
        if projections not in ("qkv", "qk", "q"):
            raise ValueError(f"projections={projections!r}: expected 'qkv', 'qk' or 'q'")
        super().__init__(hidden_size, {p: widths[p] for p in projections}, bias,
                         tp_rank=rank, tp_size=size)
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = local_heads
        self.num_kv_heads = local_kv

    @property
    def projections(self) -> str:
        """Which of q, k, v the layer projects: "qkv", "qk" or "q"."""
        return "".join(self.shard_sizes)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> q [T, H*D], k [T, KV*D], v [T, KV*D] (this rank's heads; views of
        one matmul): as many as the layer projects."""
        return self.forward(x).split(list(self.shard_sizes.values()), dim=-1)


class MergedLinear(_FusedLinear):
    """Several projections of the same input stacked along the output dim (e.g. gate_up:
    shard 0 = gate_proj, shard 1 = up_proj). `output_sizes` are this rank's sizes."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__(input_size, {i: size for i, size in enumerate(output_sizes)}, bias,
                         tp_rank=tp_rank, tp_size=tp_size)
        self.output_sizes = list(self.shard_sizes.values())
