"""Pipeline parallelism end to end on CPU (gloo), with the multiprocess executor: two stages,
and two stages of two tensor-parallel ranks (four processes), give the single-process engine's
greedy and seeded tokens; each stage holds only its layers and their KV cache; what stages
cannot run is refused by name before any worker starts. (The Ray executor's stages:
tests/executor/test_ray_executor.py.)"""

from __future__ import annotations

import random

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError
from mrv2.engine.arg_utils import EngineArgs

import executor_helpers

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=12, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in (1, 15, 17, 40)]


def _run(model_dir, **parallel) -> tuple[list[list[list[int]]], list]:
    """Greedy then seeded token ids, and each rank's stage (executor_helpers.stage_of)."""
    llm = LLM(str(model_dir), max_model_len=128, max_num_batched_tokens=32, **parallel)
    try:
        held = []
        if parallel:
            executor = llm.llm_engine.engine_core.executor
            held = executor.collective_rpc(executor_helpers.stage_of)
        tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)]
            for params in (GREEDY, SEEDED)]
        return tokens, held
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch, extra, parallel, held", [
    # three layers on two stages: the first holds two (vLLM's split), the last the LM head
    ("llama", {}, {"pipeline_parallel_size": 2}, [(0, 2, 2), (2, 3, 1)]),
    # tied embeddings: the last stage holds the embedding too, as its LM head; four processes
    ("qwen3", {"tie_word_embeddings": True},
     {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
     [(0, 2, 2)] * 2 + [(2, 3, 1)] * 2),
])
def test_stages_give_the_single_process_tokens(tiny_model_factory, arch, extra, parallel, held):
    model_dir = tiny_model_factory(arch, num_heads=4, num_kv_heads=2, num_layers=3, **extra)
    single, _ = _run(model_dir)
    staged, ranks = _run(model_dir, **parallel)
    assert staged[0] == single[0]
    assert staged[1] == single[1] and staged[1] != staged[0]  # the seeded run sampled
    assert [tuple(r) for r in ranks] == held


@pytest.mark.parametrize("kwargs, message", [
    ({"pipeline_parallel_size": 4}, "more than the model's 3 layers"),
    ({"pipeline_parallel_size": 2, "num_scheduler_steps": 4}, "num_scheduler_steps=4"),
    ({"pipeline_parallel_size": 2, "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
    ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"},
     "pipeline_parallel_size=2 needs one worker process per rank"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size=0 must be a positive integer"),
])
def test_what_stages_cannot_run_is_refused_by_name(tiny_model_factory, kwargs, message):
    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2, num_layers=3)
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=str(model_dir), max_model_len=128, **kwargs).create_engine_config()


def test_a_model_that_cannot_be_staged_is_refused_by_name(tiny_model_factory):
    model_dir = tiny_model_factory("gemma4", num_layers=2, config={
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5})
    with pytest.raises(ConfigError, match="Gemma4ForCausalLM cannot be split into pipeline"):
        EngineArgs(model=str(model_dir), max_model_len=128,
                   pipeline_parallel_size=2).create_engine_config()


def test_stages_run_one_decode_step_per_scheduled_step(tiny_model_factory):
    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2, num_layers=3)
    config = EngineArgs(model=str(model_dir), max_model_len=128,
                        pipeline_parallel_size=2).create_engine_config()
    assert config.scheduler_config.num_scheduler_steps == 1  # not auto (runs of several)
    assert config.parallel_config.world_size == 2
    assert config.parallel_config.distributed_executor_backend == "mp"
