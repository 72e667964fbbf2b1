"""ParallelConfig: tensor-parallel size, expert parallelism, and the executor backend that
follows from them or is asked for (the Ray executor itself: tests/executor/test_ray_executor.py)."""

from __future__ import annotations

import importlib.util

import pytest

from mrv2.engine.arg_utils import EngineArgs
from mrv2.errors import ConfigError
from mrv2.parallel_config import ParallelConfig


def test_backend_follows_tp():
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert ParallelConfig(1, "mp").distributed_executor_backend == "mp"
    assert ParallelConfig(2, "ray").distributed_executor_backend == "ray"
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 needs one worker process"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ConfigError, match="expected 'uni', 'mp' or 'ray'"):
        ParallelConfig(distributed_executor_backend="external_launcher")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            ParallelConfig(tensor_parallel_size=bad)


def test_ray_without_ray_installed_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs Ray, an optional extra: pip install "
                                          r"'mrv2\[ray\]'"):
        ParallelConfig(distributed_executor_backend="ray")


def test_enable_expert_parallel_is_a_boolean_engine_args_pass_on() -> None:
    assert not ParallelConfig().enable_expert_parallel
    with pytest.raises(ConfigError, match="enable_expert_parallel='yes' must be a boolean"):
        ParallelConfig(enable_expert_parallel="yes")
    with pytest.raises(ConfigError, match="enable_expert_parallel=1"):
        EngineArgs(model="/m", enable_expert_parallel=1)  # checked when built, as tp
    # The worker's ParallelConfig carries it (end to end: tests/entrypoints/
    # test_tensor_parallel.py); at tp 1 and on a dense model it is accepted, a no-op.
    assert EngineArgs(model="/m", tensor_parallel_size=2, enable_expert_parallel=True
                      )._parallel_config().enable_expert_parallel


def test_a_model_that_cannot_be_staged_is_refused_by_name():
    """Gemma 4's KV-shared layers and per-layer inputs cross stages (the config alone: no
    model is built)."""
    from types import SimpleNamespace

    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(
            architectures=["Gemma4ForCausalLM"]), num_layers=4, runner="generate"),
        speculative_config=None, scheduler_config=SimpleNamespace(num_scheduler_steps=1))
    with pytest.raises(ConfigError, match="Gemma4ForCausalLM cannot be split into pipeline"):
        ParallelConfig(pipeline_parallel_size=2).verify_pipeline(config)
    config.model_config.hf_config.architectures = ["LlamaForCausalLM"]
    ParallelConfig(pipeline_parallel_size=2).verify_pipeline(config)  # accepted
    ParallelConfig().verify_pipeline(config)  # one stage: nothing to check
