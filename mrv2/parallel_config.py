"""How the engine spreads over processes: tensor-parallel ranks and the executor that runs them."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mrv2.errors import ConfigError

if TYPE_CHECKING:  # config.py imports this module
    from mrv2.config import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    """`tensor_parallel_size` worker ranks, each holding 1/tp of the heads, of the MLP and of
    the vocabulary (mrv2/distributed.py, mrv2/models/layers/linear.py), and of every expert's
    intermediate; or, with `enable_expert_parallel` (vLLM's), 1/tp of the experts, whole
    (mrv2/models/layers/moe.py; a no-op at tp 1 and for a model without experts).

    `distributed_executor_backend`: "uni" runs the worker in the engine core's process, "mp"
    runs one worker process per rank fed over shared memory, "ray" the same workers as Ray
    actors placed on a Ray cluster (vLLM's names; Ray is the `ray` extra). None picks "uni"
    for one rank and "mp" for more; "uni" with more than one rank is refused.
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        tp, ep = self.tensor_parallel_size, self.enable_expert_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size={tp!r} must be a positive integer")
        if not isinstance(ep, bool):
            raise ConfigError(f"enable_expert_parallel={ep!r} must be a boolean")
        backend = self.distributed_executor_backend
        if backend is None:
            object.__setattr__(self, "distributed_executor_backend", "mp" if tp > 1 else "uni")
        elif backend not in ("uni", "mp", "ray"):
            raise ConfigError(f"distributed_executor_backend={backend!r}: expected 'uni', 'mp' "
                              f"or 'ray'")
        elif backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError("distributed_executor_backend='ray' needs Ray, an optional extra: "
                              "pip install 'mrv2[ray]'")
        elif backend == "uni" and tp > 1:
            raise ConfigError(f"tensor_parallel_size={tp} needs one worker process per rank: use "
                              f"distributed_executor_backend='mp' (or leave it unset), not 'uni'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def verify_model(self, model_config: ModelConfig) -> None:
        """Refuse a model whose attention or KV heads the ranks cannot split evenly."""
        tp = self.tensor_parallel_size
        if tp == 1 or model_config.hf_config is None:
            return
        heads, kv_heads = model_config.num_attention_heads, model_config.num_kv_heads
        for what, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if value % tp:
                raise ConfigError(f"tensor_parallel_size={tp} does not divide the model's {what}="
                                  f"{value} (num_attention_heads={heads}, num_key_value_heads="
                                  f"{kv_heads}); choose a tensor_parallel_size that divides both")
        intermediate = getattr(model_config.hf_config, "intermediate_size", None)
        if isinstance(intermediate, int) and intermediate % tp:
            raise ConfigError(f"tensor_parallel_size={tp} does not divide the model's "
                              f"intermediate_size={intermediate} (the MLP is split evenly "
                              f"over the ranks)")
