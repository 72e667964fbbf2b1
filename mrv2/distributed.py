"""Process groups: init, this rank's place, the two collectives tensor parallelism needs, and the
point-to-point hand-over and broadcast pipeline stages need (mrv2/pipeline.py).

Every worker process is one rank of `world_size = tensor_parallel_size x
pipeline_parallel_size`: global rank r is stage r // tp, tensor-parallel rank r % tp. Without
stages the tensor-parallel collectives run on the default group; with them, on the group of
the stage's ranks (created by every rank, in stage order, as torch.distributed requires).

`init_distributed` is called once per worker before its model is built; the model's parallel
layers read `get_tp_rank()` / `get_tp_size()` when constructed (or take an
explicit rank/size, which the loader unit tests use without any process group). The same call
records whether MoE layers split their experts over the group instead (`get_expert_parallel()`,
ParallelConfig.enable_expert_parallel; models/layers/moe.py): one group serves both, since
every rank still computes every token.

Gloo on CPU, NCCL on CUDA. With a world of one no process group is created and the
collectives return their input, so tp=1 runs exactly the single-process code path.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from executor.process import distributed_init_method, get_open_port

_TP_RANK = 0
_TP_SIZE = 1
_EXPERT_PARALLEL = False  # whole experts per rank (1/tp of them) rather than 1/tp of each
_GROUP_OWNED = False  # whether init_distributed created the default group (and must destroy it)
_PP_RANK = 0
_PP_SIZE = 1
_TP_GROUP = None  # this stage's tensor-parallel group; None: the default group (one stage)

DEFAULT_TIMEOUT_S = 600.0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(rank: int, world_size: int, init_method: str | None,
                     device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                     expert_parallel: bool = False, pipeline_parallel_size: int = 1) -> None:
    """Join the world as `rank` of `world_size` (no group for one rank), with
    `pipeline_parallel_size` stages of world_size // pipeline_parallel_size tensor-parallel
    ranks; `expert_parallel`: the MoE layers built after this split their experts over the
    stage's ranks."""
    global _TP_RANK, _TP_SIZE, _GROUP_OWNED, _EXPERT_PARALLEL, _PP_RANK, _PP_SIZE, _TP_GROUP
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    pp = pipeline_parallel_size
    if pp < 1 or world_size % pp:
        raise ValueError(f"pipeline_parallel_size={pp} does not divide a world of {world_size}")
    tp = world_size // pp
    if world_size > 1:
        if init_method is None:
            raise ValueError(f"world_size={world_size} needs a distributed init address")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process")
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        _GROUP_OWNED = True
        # A first collective makes a wrong address or a missing peer fail here, at start-up.
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)
        if int(probe.item()) != world_size:
            raise RuntimeError(f"all_reduce probe gave {probe.item()}, expected {world_size}")
        if pp > 1 and tp > 1:
            for stage in range(pp):
                group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
                if stage == rank // tp:
                    _TP_GROUP = group
    _TP_RANK, _TP_SIZE, _EXPERT_PARALLEL = rank % tp, tp, expert_parallel
    _PP_RANK, _PP_SIZE = rank // tp, pp


def destroy_distributed() -> None:
    global _TP_RANK, _TP_SIZE, _GROUP_OWNED, _EXPERT_PARALLEL, _PP_RANK, _PP_SIZE, _TP_GROUP
    if _GROUP_OWNED and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP_OWNED = False
    _TP_RANK, _TP_SIZE, _EXPERT_PARALLEL = 0, 1, False
    _PP_RANK, _PP_SIZE, _TP_GROUP = 0, 1, None


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_expert_parallel() -> bool:
    return _EXPERT_PARALLEL


def get_pp_rank() -> int:
    return _PP_RANK


def get_pp_size() -> int:
    return _PP_SIZE


def is_first_stage() -> bool:
    return _PP_RANK == 0


def is_last_stage() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def pp_send(tensors: list[torch.Tensor]) -> None:
    """To this tensor-parallel rank of the next stage, in order (blocks until received)."""
    dst = (_PP_RANK + 1) * _TP_SIZE + _TP_RANK
    for x in tensors:
        dist.send(x.contiguous(), dst)


def pp_recv(tensors: list[torch.Tensor]) -> None:
    """Fill `tensors` in place, in order, from this tensor-parallel rank of the previous stage."""
    src = (_PP_RANK - 1) * _TP_SIZE + _TP_RANK
    for x in tensors:
        dist.recv(x, src)


def broadcast_from_last_stage(x: torch.Tensor, async_op: bool = False) -> Any:
    """`x` of the last stage's first rank, in place on every rank of the world; with
    `async_op` the receipt to `wait()` on (x is filled once it returns)."""
    return dist.broadcast(x, src=(_PP_SIZE - 1) * _TP_SIZE, async_op=async_op)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (in place when there is more than one)."""
    if _TP_SIZE == 1:
        return x
    if not x.is_contiguous():
        x = x.contiguous()
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, rank order; the result is identical (bitwise)
    on every rank."""
    if _TP_SIZE == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x, group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size="
                         f"{denominator}")
    return numerator // denominator


__all__ = ["broadcast_from_last_stage", "destroy_distributed", "distributed_init_method",
           "divide", "get_expert_parallel", "get_open_port", "get_pp_rank", "get_pp_size",
           "get_tp_rank", "get_tp_size", "init_distributed", "is_first_stage", "is_last_stage",
           "pp_recv", "pp_send", "tp_all_gather", "tp_all_reduce"]
