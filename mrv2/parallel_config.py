"""How the engine spreads over processes: tensor-parallel ranks, pipeline stages, the executor
that runs them, and data-parallel engine cores."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mrv2.errors import ConfigError

if TYPE_CHECKING:  # config.py imports this module
    from mrv2.config import EngineConfig, ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    """`tensor_parallel_size` worker ranks, each holding 1/tp of the heads, of the MLP and of
    the vocabulary (mrv2/distributed.py, mrv2/models/layers/linear.py), and of every expert's
    intermediate; or, with `enable_expert_parallel` (vLLM's), 1/tp of the experts, whole
    (mrv2/models/layers/moe.py; a no-op at tp 1 and for a model without experts).

    `pipeline_parallel_size` stages, each holding a contiguous run of the decoder layers (and
    their KV cache), each stage `tensor_parallel_size` ranks (mrv2/pipeline.py). Global rank
    r is stage r // tp, tensor-parallel rank r % tp (vLLM's order).

    `data_parallel_size` engine cores, each with the whole model (and its own world of ranks),
    behind one front end that spreads requests over them (mrv2/engine/dp_client.py; the
    server's AsyncLLM). `data_parallel_backend`: "mp" starts each core as a process of this
    machine, "ray" as a Ray actor placed on the cluster (mrv2/engine/ray_core.py), its ranks
    on its node with the "mp" or "uni" executor.

    `distributed_executor_backend`: "uni" runs the worker in the engine core's process, "mp"
    runs one worker process per rank fed over shared memory, "ray" the same workers as Ray
    actors placed on a Ray cluster (vLLM's names; Ray is the `ray` extra). None picks "uni"
    for one rank and "mp" for more; "uni" with more than one rank is refused.
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"

    def __post_init__(self) -> None:
        tp, ep = self.tensor_parallel_size, self.enable_expert_parallel
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"{name}={size!r} must be a positive integer")
        world = self.world_size
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ConfigError(f"data_parallel_backend={self.data_parallel_backend!r}: expected "
                              f"'mp' or 'ray'")
        if self.data_parallel_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError("data_parallel_backend='ray' needs Ray, an optional extra: "
                              "pip install 'mrv2[ray]'")
        if not isinstance(ep, bool):
            raise ConfigError(f"enable_expert_parallel={ep!r} must be a boolean")
        backend = self.distributed_executor_backend
        if backend is None:
            object.__setattr__(self, "distributed_executor_backend",
                               "mp" if world > 1 else "uni")
        elif backend not in ("uni", "mp", "ray"):
            raise ConfigError(f"distributed_executor_backend={backend!r}: expected 'uni', 'mp' "
                              f"or 'ray'")
        elif backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError("distributed_executor_backend='ray' needs Ray, an optional extra: "
                              "pip install 'mrv2[ray]'")
        elif backend == "ray" and self.data_parallel_backend == "ray":
            raise ConfigError("data_parallel_backend='ray' places each engine core as a Ray "
                              "actor with its ranks on its node: use distributed_executor_"
                              "backend='mp' (or leave it unset), not 'ray'")
        elif backend == "uni" and world > 1:
            what = (f"tensor_parallel_size={tp}" if self.pipeline_parallel_size == 1 else
                    f"tensor_parallel_size={tp} x pipeline_parallel_size="
                    f"{self.pipeline_parallel_size}")
            raise ConfigError(f"{what} needs one worker process per rank: use "
                              f"distributed_executor_backend='mp' (or leave it unset), not 'uni'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def verify_pipeline(self, config: EngineConfig) -> None:
        """Refuse, by name, what pipeline stages do not run: a stage without layers, a model
        whose layers cannot be split, and the features whose steps are not one forward of
        every stage followed by one sampling on the last."""
        pp = self.pipeline_parallel_size
        if pp == 1:
            return
        model = config.model_config
        if model.hf_config is not None:
            from mrv2.models.registry import get_model_class

            model_class = get_model_class(getattr(model.hf_config, "architectures", None))
            if not getattr(model_class, "supports_pipeline_parallel", False):
                raise ConfigError(f"pipeline_parallel_size={pp}: {model_class.__name__} cannot "
                                  f"be split into pipeline stages")
            if model.num_layers < pp:
                raise ConfigError(f"pipeline_parallel_size={pp} is more than the model's "
                                  f"{model.num_layers} layers (each stage needs one)")
        refused = {"speculative_config": config.speculative_config is not None,
                   "runner='pooling'": model.runner == "pooling",
                   # None is auto, which runs several: EngineArgs gives 1 under stages
                   f"num_scheduler_steps={config.scheduler_config.num_scheduler_steps}":
                   config.scheduler_config.num_scheduler_steps != 1}
        for what, asked in refused.items():
            if asked:
                raise ConfigError(f"pipeline_parallel_size={pp} with {what}: not supported "
                                  f"(each step runs one forward through the stages)")

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
