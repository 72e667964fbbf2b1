"""Multi-step decoding (core/decode_steps.py): the rule that picks how many decode steps a
scheduled step runs, and end to end through the scheduler and the runner: the same greedy
tokens as one decode step at a time, stop tokens and length limits inside a run, mixed batches,
with async scheduling on and off, a NaN inside a run."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.config import AUTO_DECODE_STEPS
from mrv2.core.decode_steps import (AUTO_DECODE_STEPS_MAX, AUTO_RUN_SECONDS, AutoRunLength,
                                    decode_steps)
from mrv2.core.request import Request
from mrv2.core.scheduler import Scheduler
from mrv2.outputs import RequestOutputKind
from mrv2.sampling_params import StructuredOutputsParams


def _decoding(max_tokens: int = 20, outputs: int = 3, placeholders: int = 0,
              **params) -> Request:
    """A running greedy request (unless `params` say otherwise) that decodes next: a 5-token
    prompt, `outputs` tokens sampled, its KV computed up to the last known token."""
    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **params})
    request = Request("r", [5, 6, 7, 8, 9], params, eos_token_id=1)
    request.append_output_token_ids([10] * outputs)
    request.num_output_placeholders = placeholders
    request.num_computed_tokens = len(request.all_token_ids) + placeholders - 1
    return request


def _steps(running, waiting=0, k=8, max_model_len=64, free_blocks=100, block_size=4,
           auto_steps=AUTO_DECODE_STEPS) -> int:
    return decode_steps(running, waiting, k, max_model_len, free_blocks, block_size, auto_steps)


def test_greedy_decoding_rows_run_the_configured_steps():
    assert _steps([_decoding(), _decoding()]) == 8
    assert _steps([_decoding()], k=1) == 1
    assert _steps([]) == 1


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(logprobs=2),
                                    dict(stop=["x"]), dict(min_tokens=5),
                                    dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[3, 4]),
                                    dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
                                    dict(structured_outputs=StructuredOutputsParams(
                                        choice=["a", "b"]))])
def test_a_row_that_reads_more_than_the_argmax_runs_one_step(params):
    assert _steps([_decoding(), _decoding(**params)]) == 1


def test_by_default_rows_that_take_their_output_at_the_end_run_the_auto_steps():
    final = dict(output_kind=RequestOutputKind.FINAL_ONLY)
    assert _steps([_decoding(**final), _decoding(**final)], k=None) == AUTO_DECODE_STEPS > 1
    for streams in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        # one streaming row keeps the batch on single steps; an explicit count runs it too
        assert _steps([_decoding(**final), _decoding(output_kind=streams)], k=None) == 1
        assert _steps([_decoding(**final), _decoding(output_kind=streams)], k=8) == 8
    assert _steps([_decoding(**final, temperature=0.8)], k=None) == 1


def test_auto_runs_last_about_auto_run_seconds():
    length = AutoRunLength()
    assert length.steps == AUTO_DECODE_STEPS  # nothing timed yet
    length.record(1, 0.001)  # a single step says nothing of a run's steps
    assert length.step_seconds is None
    length.record(8, 8 * AUTO_RUN_SECONDS / 20)  # steps of 1/20 of a run's time: 20 a run
    assert length.steps == 20
    length.record(8, 8 * AUTO_RUN_SECONDS / 20)
    assert length.steps == 20
    length.record(8, 8 * AUTO_RUN_SECONDS)  # one slow run moves the estimate, within bounds
    assert AUTO_DECODE_STEPS <= length.steps < 20
    for _ in range(30):  # long steps: the shortest auto run
        length.record(8, 8 * AUTO_RUN_SECONDS)
    assert length.steps == AUTO_DECODE_STEPS
    for _ in range(30):  # very short steps: the longest
        length.record(32, 32 * AUTO_RUN_SECONDS / 1000)
    assert length.steps == AUTO_DECODE_STEPS_MAX
    final = dict(max_tokens=100, output_kind=RequestOutputKind.FINAL_ONLY)
    assert _steps([_decoding(**final)], k=None, auto_steps=20) == 20
    assert _steps([_decoding(**final)], k=4, auto_steps=20) == 4  # a count given wins
    fixed = AutoRunLength(timed=False)  # speculative decoding's
    fixed.record(8, 8 * AUTO_RUN_SECONDS / 1000)
    assert fixed.steps == AUTO_DECODE_STEPS


def test_waiting_requests_and_prefill_rows_run_one_step():
    assert _steps([_decoding()], waiting=1) == 1
    prefill = _decoding()
    prefill.num_computed_tokens -= 2  # two tokens to compute: a prefill chunk
    assert _steps([_decoding(), prefill]) == 1


def test_no_row_passes_its_length_limits():
    # max_tokens: 20 - 3 outputs = 17 left; 20 - 15 = 5; in flight (placeholders) count too.
    assert _steps([_decoding(), _decoding(outputs=15)]) == 5
    assert _steps([_decoding(outputs=10, placeholders=4)]) == 6
    assert _steps([_decoding(outputs=19)]) == 1
    # max_model_len: 8 known tokens, room for 4 more.
    assert _steps([_decoding()], max_model_len=12) == 4


def test_a_run_ends_where_a_request_may_draft_again():
    """Speculative decoding: a request the runner drafts for again after 3 steps (its last
    output's pause) keeps the run to 3; one it looks for after its next step to 1."""
    pausing, looking = _decoding(), _decoding()
    pausing.steps_without_drafts, looking.steps_without_drafts = 3, 0
    assert _steps([_decoding(), pausing]) == 3
    assert _steps([pausing, looking]) == 1


def test_a_short_pool_runs_one_step():
    # 8 steps span up to 3 blocks of 4 a row: two rows need 6 free blocks.
    assert _steps([_decoding(), _decoding()], free_blocks=6) == 8
    assert _steps([_decoding(), _decoding()], free_blocks=5) == 1


def _generate(path, prompts, params, **engine) -> tuple[list[list[int]], list[str], list[int]]:
    """(token ids, finish reasons, the decode steps of every scheduled step)."""
    llm = LLM(str(path), max_model_len=96, max_num_seqs=4, **engine)
    scheduler: Scheduler = llm.llm_engine.engine_core.scheduler
    steps: list[int] = []
    schedule = scheduler.schedule

    def spy():
        out = schedule()
        steps.append(out.num_decode_steps)
        return out

    scheduler.schedule = spy
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs],
            steps)


def _record_runs(monkeypatch, record=lambda out: out[0].numpy().copy()) -> list:
    """FusedDecode.run_steps spied on from now (before an engine's worker binds it): what
    `record` makes of each call's result (by default a copy of its tokens), in call order."""
    from mrv2.models.cpu.decode import FusedDecode

    runs = []
    run_steps = FusedDecode.run_steps

    def spy(self, *args):
        out = run_steps(self, *args)
        runs.append(record(out))
        return out

    monkeypatch.setattr(FusedDecode, "run_steps", spy)
    return runs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_runs_of_decode_steps_give_the_one_step_tokens(tiny_llama, async_scheduling):
    prompts = [{"prompt_token_ids": [5, 17, 300 + i, 42, 1000, 7]} for i in range(3)]
    # Lengths that are not multiples of the run; the third ends at a stop token mid-run.
    one = _generate(tiny_llama, prompts, [SamplingParams(temperature=0.0, max_tokens=n,
                                                         ignore_eos=True) for n in (3, 11, 20)],
                    async_scheduling=async_scheduling, num_scheduler_steps=1)
    stop = one[0][2][9]  # the third request's tenth token (an earlier equal one stops first)
    first = one[0][2].index(stop)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                             stop_token_ids=[stop] if i == 2 else None)
              for i, n in enumerate((3, 11, 20))]
    tokens, reasons, steps = _generate(tiny_llama, prompts, params, num_scheduler_steps=4,
                                       async_scheduling=async_scheduling)
    assert tokens[:2] == one[0][:2] and reasons[:2] == ["length", "length"]
    assert tokens[2] == one[0][2][:first + 1] and reasons[2] == "stop"
    assert max(steps) == 4 and all(1 <= s <= 4 for s in steps)


@pytest.mark.parametrize("async_scheduling", [None, True])
def test_a_stop_inside_a_run_is_seen_before_the_next_run_on_the_cpu(tiny_llama,
                                                                   async_scheduling):
    """One CPU process schedules synchronously by default (EngineArgs.async_scheduling None): the
    scheduler has a run's tokens before it schedules again, so a request that stops inside a run
    is not run again. With async scheduling a run of placeholders was already scheduled when
    the stop came back (its tokens are dropped)."""
    import math

    prompt = [{"prompt_token_ids": [5, 17, 300, 42, 1000, 7]}]
    one = _generate(tiny_llama, prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                       ignore_eos=True),
                    num_scheduler_steps=1)[0][0]
    first = one.index(one[20])
    llm = LLM(str(tiny_llama), max_model_len=96, max_num_seqs=4, num_scheduler_steps=8,
              async_scheduling=async_scheduling)
    scheduler: Scheduler = llm.llm_engine.engine_core.scheduler
    decode_steps_run: list[int] = []
    schedule = scheduler.schedule

    def spy():
        out = schedule()
        if out.num_reqs and out.num_scheduled.max() == 1:  # a decode step (or a run)
            decode_steps_run.append(out.num_decode_steps)
        return out

    scheduler.schedule = spy
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                              stop_token_ids=[one[20]]), use_tqdm=False)
    llm.shutdown()
    assert list(out[0].outputs[0].token_ids) == one[:first + 1]
    # The prefill samples the first token; every later one is a decode step of a run of 8.
    needed = math.ceil(first / 8) * 8
    if async_scheduling:
        assert sum(decode_steps_run) > needed
    else:
        assert sum(decode_steps_run) == needed


def test_defaults_run_steps_for_generate_and_single_steps_for_a_stream(tiny_llama):
    """LLM.generate (FINAL_ONLY) runs the auto steps with the one-step tokens (the first run
    AUTO_DECODE_STEPS long, later ones as AutoRunLength times them); a DELTA request on the
    same defaults gets one token per step output."""
    prompts = [{"prompt_token_ids": [5, 17, 300 + i, 42]} for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    one, _, one_steps = _generate(tiny_llama, prompts, params, num_scheduler_steps=1)
    tokens, _, steps = _generate(tiny_llama, prompts, params)
    runs = [s for s in steps if s > 1]
    assert tokens == one and set(one_steps) == {1} and runs[0] == AUTO_DECODE_STEPS
    assert sum(runs) >= 30 and max(runs) <= AUTO_DECODE_STEPS_MAX
    llm = LLM(str(tiny_llama), max_model_len=96, max_num_seqs=4)
    engine = llm.llm_engine
    engine.add_request("s", prompts[0], params, RequestOutputKind.DELTA)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [len(o.outputs[0].token_ids) for o in engine.step()]
    assert set(deltas) == {1} and len(deltas) == 40
    llm.shutdown()


def test_a_sampling_row_keeps_the_batch_on_single_steps(tiny_llama):
    prompts = [{"prompt_token_ids": [5, 17, 300, 42]}, {"prompt_token_ids": [9, 8, 7]}]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)]
    one, _, _ = _generate(tiny_llama, prompts, params, num_scheduler_steps=1)
    tokens, _, steps = _generate(tiny_llama, prompts, params, num_scheduler_steps=4)
    assert tokens == one
    # While the seeded row runs, every step is one decode step; then the greedy row runs on.
    assert steps[:6] == [1] * 6 and max(steps) == 4


def test_the_fused_stack_runs_a_row_s_further_steps_in_one_call(tiny_llama, monkeypatch):
    """On the CPU the fused decode stack with its LM head takes a run's further steps as one
    call (FusedDecode.run_steps); its tokens are those of the step-by-step loop (the call
    refused) and of one decode step at a time, across block boundaries and a stop mid-run."""
    from mrv2.models.cpu.decode import FusedDecode

    prompts = [{"prompt_token_ids": [5, 17, 300 + i, 42, 1000, 7]} for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (5, 23, 40)]
    one, _, _ = _generate(tiny_llama, prompts, params, num_scheduler_steps=1)
    stop = one[2][30]
    params[2] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                               stop_token_ids=[stop])
    expected = one[:2] + [one[2][:one[2].index(stop) + 1]]
    runs = _record_runs(monkeypatch, lambda out: None if out is None else tuple(out[0].shape))
    tokens, _, steps = _generate(tiny_llama, prompts, params, num_scheduler_steps=8)
    assert tokens == expected and max(steps) == 8
    assert runs and all(r is not None and r[1] <= 8 for r in runs)
    assert any(r[1] == 8 for r in runs)  # two rows from 23 and 40 tokens: whole runs
    monkeypatch.setattr(FusedDecode, "run_steps", lambda self, *args: None)
    tokens, _, _ = _generate(tiny_llama, prompts, params, num_scheduler_steps=8)
    assert tokens == expected


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_run_ends_where_every_row_has_stopped(tiny_llama, monkeypatch, ignore_eos):
    """The stack's one call for a run ends after the step where every row sampled one of its
    stop ids (sampler/run_stops.py): the columns after it repeat that token instead of the
    argmax going on, and each request gets the tokens of one step at a time up to its stop.
    A row without stop ids (ignore_eos and none given) keeps the run going to its end."""

    prompts = [{"prompt_token_ids": [5, 17, 300 + i, 42, 1000, 7]} for i in range(2)]
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    one, _, _ = _generate(tiny_llama, prompts, free, num_scheduler_steps=1)
    # A stop inside a run (after the prefill's token: runs of 8 from the second token) whose
    # next token differs, so a call that went on would show another token after it.
    picks = [next(k for k in range(10, 30) if k % 8 not in (0, 1) and tokens.index(tokens[k]) == k
                  and tokens[k + 1] != tokens[k]) for tokens in one]
    # Request 0 stops on its EOS (the model's id, as the engine passes it), request 1 on a
    # stop_token_id; with ignore_eos request 0 has no stop id and runs to its max_tokens.
    eos = one[0][picks[0]]
    monkeypatch.setattr("mrv2.engine.input_processor.eos_token_ids", lambda *a, **k: (eos,))
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=ignore_eos),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                             stop_token_ids=[one[1][picks[1]]])]
    runs = _record_runs(monkeypatch)
    tokens, reasons, _ = _generate(tiny_llama, prompts, params, num_scheduler_steps=8)
    assert tokens[1] == one[1][:picks[1] + 1] and reasons[1] == "stop"
    if ignore_eos:  # a run that had ended at request 1's stop would repeat its tokens
        assert tokens[0] == one[0] and reasons[0] == "length"
        return
    assert tokens[0] == one[0][:picks[0] + 1] and reasons[0] == "stop"
    last = runs[-1]  # both rows stopped in it: it ended at the later stop
    column = max(list(row).index(stop) for row, stop in zip(last, (eos, one[1][picks[1]])))
    assert column < last.shape[1] - 1
    assert (last[:, column + 1:] == last[:, column:column + 1]).all()


def test_a_run_whose_first_token_stops_every_row_runs_no_step(tiny_llama, monkeypatch):
    """A run's column 0 is the token the step before sampled (its first decode step, on the
    runner's own path): where that stops every row, the stack's call runs no step at all."""

    prompt = [{"prompt_token_ids": [5, 17, 300, 42, 1000, 7]}]
    one = _generate(tiny_llama, prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                       ignore_eos=True),
                    num_scheduler_steps=1)[0][0]
    # Runs of 8 from output 1: output 9 is the first token of the second run.
    assert one.index(one[9]) == 9, "the tiny model repeats itself: pick another prompt"
    runs = _record_runs(monkeypatch)
    tokens, reasons, _ = _generate(tiny_llama, prompt, SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[one[9]]),
        num_scheduler_steps=8)
    assert tokens[0] == one[:10] and reasons[0] == "stop"
    assert (runs[-1] == one[9]).all()  # no argmax after it


def test_a_nan_inside_a_run_fails_only_its_request(tiny_llama, monkeypatch):
    """A row whose logits turn NaN at a step inside a run (the stack's one call: its argmax
    flags the row) ends with "error" and no token of that run; the other row of the batch
    generates what it would alone."""
    import torch

    runs = _record_runs(monkeypatch, lambda out: None if out is None else (
        tuple(out[0].shape), bool(out[1].any())))  # before the worker binds it
    bad_prompt, clean_prompt = [5, 17, 300, 42], [9, 8, 7, 600]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_llama), max_model_len=64, max_num_seqs=4, enable_prefix_caching=False,
              num_scheduler_steps=8)
    bad_expected, clean_expected = (o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in (bad_prompt, clean_prompt)], greedy, use_tqdm=False))
    # A token the bad row samples at position p (2..6, first seen there) and the clean row
    # never reads: its embedding made NaN, the bad row's logits turn NaN at the step that reads
    # it, inside the run of steps 2..8.
    position = next(p for p in range(2, 7) if bad_expected[p] not in
                    bad_prompt + bad_expected[:p] + clean_prompt + clean_expected)
    runs.clear()
    model = llm.llm_engine.engine_core.executor.worker.model
    with torch.no_grad():
        model.model.embed_tokens.weight[bad_expected[position]] = float("nan")
    bad, clean = llm.generate([{"prompt_token_ids": p} for p in (bad_prompt, clean_prompt)],
                              greedy, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == bad_expected[:len(bad.outputs[0].token_ids)]
    assert len(bad.outputs[0].token_ids) <= position + 1
    assert clean.outputs[0].token_ids == clean_expected
    assert clean.outputs[0].finish_reason == "length"
    assert ((2, 8), True) in runs  # the NaN came out of the run's one call
    llm.shutdown()


def test_runs_of_steps_on_a_hybrid_kv_layout(tiny_model_factory, monkeypatch):
    """Gemma 2's windowed and full layers read two KV cache groups (core/kv_cache_layout.py):
    the stack's run of steps computes each group's slots from its own table, and the windowed
    group's blocks given back behind the window are never read: the one-step tokens."""

    path = tiny_model_factory("gemma2", config={
        "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24, "final_logit_softcapping": 8.0})
    prompts = [{"prompt_token_ids": [5, 17, 300 + i, 42, 1000, 7]} for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    one, _, _ = _generate(path, prompts, params, block_size=4, dtype="float32")
    runs = _record_runs(monkeypatch, lambda out: out is not None)
    tokens, _, steps = _generate(path, prompts, params, block_size=4, dtype="float32",
                                 num_scheduler_steps=8)
    assert tokens == one and max(steps) == 8 and runs and all(runs)
