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
from mrv2.utils import free_cores

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
            # Each of the ranks on this machine started with its share of the cores.
            share = int(free_cores.pool_env(executor.world_size)["NUMBA_NUM_THREADS"])
            pools = executor.collective_rpc(executor_helpers.pool_sizes)
            assert pools == [[share, share]] * executor.world_size  # msgspec: lists
        tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)]
            for params in (GREEDY, SEEDED)]
        return tokens, held
    finally:
        llm.shutdown()


def test_two_stages_of_two_ranks_give_the_single_process_tokens(tiny_model_factory):
    """Four processes, one step at a time (async scheduling off: no micro-batches). Three
    layers on two stages: the first holds two (vLLM's split), the last one and the LM head;
    with tied embeddings the last stage holds the embedding too, as its LM head."""
    model_dir = tiny_model_factory("qwen3", num_heads=4, num_kv_heads=2, num_layers=3,
                                   tie_word_embeddings=True)
    single, _ = _run(model_dir)
    staged, ranks = _run(model_dir, pipeline_parallel_size=2, tensor_parallel_size=2,
                         async_scheduling=False)
    assert staged[0] == single[0]
    assert staged[1] == single[1] and staged[1] != staged[0]  # the seeded run sampled
    assert [tuple(r) for r in ranks] == [(0, 2, 2)] * 2 + [(2, 3, 1)] * 2


def test_micro_batches_keep_disjoint_requests_in_both_stages(tiny_model_factory):
    """With async scheduling (the default) the engine keeps a step in flight per stage, each
    with its share of the requests and none in both: the first stage computes one while the
    last computes the other. The tokens stay the single-process engine's."""
    from mrv2.core.engine_core import EngineCore
    from mrv2.protocol import EngineCoreRequest

    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2, num_layers=3)
    single, _ = _run(model_dir)
    config = EngineArgs(model=str(model_dir), max_model_len=128, max_num_batched_tokens=32,
                        pipeline_parallel_size=2).create_engine_config()
    assert config.max_steps_in_flight == 2
    core = EngineCore(config)
    in_flight_at_submit: list[tuple[set[str], list[set[str]]]] = []
    submit = core.executor.execute_model

    def watched_submit(step, non_block=False):  # what is in flight as a step goes in
        in_flight_at_submit.append((set(step.req_ids),
                                    [set(s.req_ids) for s, _, _ in core.batch_queue]))
        return submit(step, non_block)

    core.executor.execute_model = watched_submit
    try:
        for i, prompt in enumerate(_prompts()):
            core.add_request(EngineCoreRequest(f"{i}", prompt, GREEDY, None, 0.0))
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    finally:
        core.shutdown()
    assert [tokens[str(i)] for i in range(4)] == single[0]
    overlapped = [(new, old) for new, old in in_flight_at_submit if old]
    assert overlapped and all(not new & prior for new, old in overlapped for prior in old)


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


def test_stages_run_one_decode_step_per_scheduled_step(tiny_model_factory):
    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2, num_layers=3)
    config = EngineArgs(model=str(model_dir), max_model_len=128,
                        pipeline_parallel_size=2).create_engine_config()
    assert config.scheduler_config.num_scheduler_steps == 1  # not auto (runs of several)
    assert config.parallel_config.world_size == 2
    assert config.parallel_config.distributed_executor_backend == "mp"
