"""The runner's dummy requests: warm-up (every kernel once before the first request) and the
profile run (the largest step, before the KV cache is sized) drive ModelRunner with these."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mrv2.protocol import NULL_BLOCK_ID, CachedRequestData, NewRequestData, SchedulerOutput
from mrv2.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mrv2.runner import ModelRunner

# Period of the dummy prompts' tokens: a prompt that repeats, so an n-gram or suffix
# proposer drafts and the warm-up runs a verify step too.
PROMPT_PERIOD = 7


def run_dummy_requests(runner: ModelRunner, params: list[SamplingParams], prompt_len: int,
                       decode: bool) -> None:
    """Prefill one request per `params` (prompts of up to `prompt_len` tokens, within every
    limit), decode one token each when `decode` (and, where they drafted, verify their
    drafts), then finish them. Their KV goes to the null block, zeroed again afterwards (a
    cache starts as zeros)."""
    config, sched = runner.config, runner.config.scheduler_config
    tables, vocab = runner.block_tables, config.model_config.vocab_size
    max_len = config.model_config.max_model_len
    prompt_len = max(1, min(prompt_len, max_len - 1,
                            sched.max_num_batched_tokens // len(params)))
    prompt = [(t % PROMPT_PERIOD + 1) % vocab for t in range(prompt_len)]
    blocks = [[NULL_BLOCK_ID] * min(config.max_num_blocks_per_req,
                                    prompt_len // tables.block_size + 1)] * tables.num_groups
    new = [NewRequestData(f"dummy-{i}", prompt, prompt, p, blocks, 0)
           for i, p in enumerate(params)]
    ids = [r.req_id for r in new]
    runner.execute_model(SchedulerOutput.build(new, CachedRequestData(),
                                               dict.fromkeys(ids, prompt_len),
                                               prompt_len * len(ids)))
    drafts = runner.sample_tokens().draft_token_ids
    if decode and prompt_len < max_len:  # room for one decoded token (and drafts)
        # A request that drafted verifies its drafts in this step (the decode step it is).
        room = min(max_len - prompt_len - 1, sched.max_num_batched_tokens // len(ids) - 1)
        num_new = ([1] * len(ids) if drafts is None
                   else [1 + max(0, min(len(d), room)) for d in drafts])
        runner.execute_model(SchedulerOutput.build(
            [], CachedRequestData.build(ids, [([],) * tables.num_groups] * len(ids),
                                        [prompt_len] * len(ids)),
            dict(zip(ids, num_new)), sum(num_new)))
        runner.sample_tokens()
    runner.execute_model(SchedulerOutput.build([], CachedRequestData(), {}, 0,
                                               finished_req_ids=ids))
    runner.sample_tokens()
    draft_caches = [] if runner.speculator is None else runner.speculator.draft_kv_caches
    for cache in (*runner.kv_caches, *draft_caches):
        # Empty: a layer of another pipeline stage; flat: a recurrent layer's state, which a
        # request's first step never reads.
        if cache.numel() and cache.dim() > 1:
            cache[:, NULL_BLOCK_ID].zero_()
