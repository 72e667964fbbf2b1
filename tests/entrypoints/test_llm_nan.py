"""A request whose logits turn NaN ends alone with finish_reason "error": the other requests of
its batch, and later ones that reuse its KV blocks, generate exactly what they would without
it (issue: failure hygiene)."""

from __future__ import annotations

import torch

from mrv2 import LLM, SamplingParams

POISON = 77  # a token whose embedding row is made NaN
CLEAN = {"prompt_token_ids": [5, 17, 300, 42, 1000, 7, 8, 9]}
# Long: its NaN keys and values fill slots that the later, shorter requests' blocks only hold
# past their sequence ends, where attention must still not read them as NaN.
POISONED = {"prompt_token_ids": [5, 17, POISON] + list(range(100, 127))}


def test_nan_logits_fail_only_their_request(tiny_llama):
    # Prefix caching off and a pool of 10 blocks (8 KiB each): the later requests recompute
    # into the freed blocks, the failed request's among them.
    llm = LLM(str(tiny_llama), max_model_len=128, max_num_seqs=8, block_size=16,
              enable_prefix_caching=False, kv_cache_memory_gb=10 * 8192 / (1 << 30))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([CLEAN], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert POISON not in expected
    model = llm.llm_engine.engine_core.executor.worker.model
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")

    bad, good = llm.generate([POISONED, CLEAN], greedy, use_tqdm=False)
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == []
    assert good.outputs[0].token_ids == expected and good.outputs[0].finish_reason == "length"
    # The failed request's blocks (NaN keys and values) go back to the pool and are reused.
    # Six rows: past the fused decode stack (at most 4 rows), through the torch attention.
    again = llm.generate([CLEAN] * 6, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [expected] * 6
    core = llm.llm_engine.engine_core
    assert core.scheduler.kv_cache_manager.usage == 0 and not core.has_unfinished_requests()
