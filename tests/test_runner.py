"""ModelRunner driven directly with hand-built SchedulerOutputs (what a synchronous scheduler
would send), checked against transformers' greedy generate on the same weights."""

from __future__ import annotations

import pytest
import torch

from mrv2.engine.arg_utils import EngineArgs
from mrv2.protocol import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from mrv2.runner import ModelRunner
from mrv2.sampling_params import SamplingParams
from mrv2.worker import Worker

BLOCK_SIZE = 16
NUM_BLOCKS = 33  # 4 seqs * 8 blocks of a 128-token request + the null block
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    """(config, model): the model is stateless, so every test gets a fresh runner around it."""
    config = EngineArgs(model=str(tiny_llama), max_model_len=128, max_num_seqs=4,
                        block_size=BLOCK_SIZE, device="cpu").create_engine_config()
    worker = Worker(config)
    worker.load_model()
    return config, worker.model


@pytest.fixture
def runner(loaded) -> ModelRunner:
    config, model = loaded
    worker = Worker(config)
    worker.model = model
    worker.initialize_kv_cache(NUM_BLOCKS)
    return worker.runner


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    cache: dict[tuple, list[int]] = {}

    def generate(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt]),
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=0)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return generate


def new_req(req_id: str, prompt: list[int], block_ids: list[int],
            params: SamplingParams = GREEDY) -> NewRequestData:
    """`block_ids`: of the one KV cache group."""
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt, prefill_token_ids=prompt,
                          sampling_params=params, block_ids=[list(block_ids)],
                          num_computed_tokens=0)


def sched(num_scheduled: dict[str, int], new: list[NewRequestData] = (),
          cached: list[tuple[str, list[int], int]] = (), finished: list[str] = ()
          ) -> SchedulerOutput:
    """cached: (req_id, block ids new this step (of the one KV cache group),
    num_computed_tokens before this step)."""
    return SchedulerOutput.build(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData.build(req_ids=[c[0] for c in cached],
                                                new_block_ids=[[list(c[1])] for c in cached],
                                                num_computed_tokens=[c[2] for c in cached]),
        num_scheduled_tokens=dict(num_scheduled),
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=list(finished))


def step(runner: ModelRunner, out: SchedulerOutput) -> ModelRunnerOutput:
    runner.execute_model(out)
    return runner.sample_tokens(None)


def by_req(output: ModelRunnerOutput) -> dict[str, list[int]]:
    return dict(zip(output.req_ids, output.sampled_token_ids))


PROMPT_A = [5, 17, 300, 42, 1000, 7, 8]
PROMPT_B = [900, 33, 12, 1500, 64, 77, 3, 250, 1234]
PROMPT_C = [40, 41, 42, 43]


def test_chunked_prompt_samples_only_after_last_chunk(runner, hf_greedy):
    prompt = PROMPT_B  # 9 tokens: chunks of 6 and 3
    out1 = step(runner, sched({"a": 6}, new=[new_req("a", prompt, [4])]))
    assert out1.req_ids == ["a"] and out1.sampled_token_ids == [[]]
    out2 = step(runner, sched({"a": 3}, cached=[("a", [], 6)]))
    assert out2.req_ids == ["a"]
    assert out2.sampled_token_ids == [hf_greedy(prompt, 1)]


def test_chunk_spanning_blocks_added_later(runner, hf_greedy):
    """A 20-token prompt in chunks of 10: the second chunk brings the second block as a delta."""
    prompt = [(i * 37 + 11) % 2000 for i in range(20)]
    assert step(runner, sched({"a": 10}, new=[new_req("a", prompt, [7])])).sampled_token_ids \
        == [[]]
    out = step(runner, sched({"a": 10}, cached=[("a", [12], 10)]))
    assert out.sampled_token_ids == [hf_greedy(prompt, 1)]


def test_decode_feeds_back_sampled_tokens_on_device(runner, hf_greedy):
    """Decode steps carry only counts; the runner must feed its own sampled tokens back."""
    prompt, n = PROMPT_A, 20  # 7 + 20 tokens crosses into a second (non-adjacent) block
    tokens = by_req(step(runner, sched({"a": len(prompt)}, new=[new_req("a", prompt, [3])])))["a"]
    blocks, num_computed = [3], len(prompt)
    while len(tokens) < n:
        new_blocks = []
        if num_computed >= len(blocks) * BLOCK_SIZE:
            new_blocks = [20 + len(blocks)]
            blocks += new_blocks
        out = step(runner, sched({"a": 1}, cached=[("a", new_blocks, num_computed)]))
        assert out.req_ids == ["a"] and len(out.sampled_token_ids[0]) == 1
        tokens += out.sampled_token_ids[0]
        num_computed += 1
    assert len(blocks) == 2
    assert tokens == hf_greedy(prompt, n)
    # The slot's token history holds the prompt and every sampled token.
    slot = runner.requests.req_id_to_slot["a"]
    history = runner.requests.token_ids.tensor[slot, :len(prompt) + n].tolist()
    assert history == prompt + tokens


def test_execute_twice_without_sample_raises(runner):
    runner.execute_model(sched({"a": 4}, new=[new_req("a", PROMPT_C, [1])]))
    with pytest.raises(RuntimeError, match="twice"):
        runner.execute_model(sched({"a": 1}, cached=[("a", [], 4)]))
    # The first step's state is intact: phase 2 still completes it.
    assert len(runner.sample_tokens(None).sampled_token_ids[0]) == 1


def test_sample_without_execute_raises(runner):
    with pytest.raises(RuntimeError, match="without a pending execute_model"):
        runner.sample_tokens(None)
    # A step with nothing scheduled (only finished ids) still completes both phases.
    runner.execute_model(sched({}, finished=["never-seen"]))
    out = runner.sample_tokens(None)
    assert out.req_ids == [] and out.sampled_token_ids == []
    with pytest.raises(RuntimeError, match="without a pending execute_model"):
        runner.sample_tokens(None)


def test_finished_slot_is_reused_without_disturbing_others(runner, hf_greedy):
    requests = runner.requests
    out = by_req(step(runner, sched({"A": len(PROMPT_A), "B": len(PROMPT_B)},
                                    new=[new_req("A", PROMPT_A, [1]),
                                         new_req("B", PROMPT_B, [2])])))
    a_tokens, b_tokens = out["A"], out["B"]
    out = by_req(step(runner, sched({"A": 1, "B": 1}, cached=[("A", [], len(PROMPT_A)),
                                                               ("B", [], len(PROMPT_B))])))
    a_tokens += out["A"]
    b_tokens += out["B"]
    assert a_tokens == hf_greedy(PROMPT_A, 2)
    slot_a = requests.req_id_to_slot["A"]
    assert requests.num_active == 2

    # A finishes; C arrives in the same step, in A's slot and on A's freed block.
    out = by_req(step(runner, sched({"B": 1, "C": len(PROMPT_C)},
                                    new=[new_req("C", PROMPT_C, [1])],
                                    cached=[("B", [], len(PROMPT_B) + 1)], finished=["A"])))
    assert "A" not in requests.req_id_to_slot
    assert requests.req_id_to_slot["C"] == slot_a
    assert requests.num_active == 2
    b_tokens += out["B"]
    c_tokens = out["C"]
    for i in range(4):
        out = by_req(step(runner, sched({"B": 1, "C": 1},
                                        cached=[("B", [], len(PROMPT_B) + 2 + i),
                                                ("C", [], len(PROMPT_C) + i)])))
        b_tokens += out["B"]
        c_tokens += out["C"]
    assert b_tokens == hf_greedy(PROMPT_B, 7)
    assert c_tokens == hf_greedy(PROMPT_C, 5)

    step(runner, sched({}, finished=["B", "C"]))
    assert requests.num_active == 0
    assert requests.num_free_slots == 4


def test_decode_rows_are_reordered_first(runner, hf_greedy):
    first = by_req(step(runner, sched({"D": len(PROMPT_A)}, new=[new_req("D", PROMPT_A, [1])])))
    # Prefill rows listed around the decode row: the batch must be decode-first, stable.
    out = step(runner, sched({"P1": len(PROMPT_B), "D": 1, "P2": len(PROMPT_C)},
                             new=[new_req("P1", PROMPT_B, [2]), new_req("P2", PROMPT_C, [3])],
                             cached=[("D", [], len(PROMPT_A))]))
    assert out.req_ids == ["D", "P1", "P2"]
    got = by_req(out)
    assert first["D"] + got["D"] == hf_greedy(PROMPT_A, 2)
    assert got["P1"] == hf_greedy(PROMPT_B, 1)
    assert got["P2"] == hf_greedy(PROMPT_C, 1)


def test_seeded_request_is_batch_invariant(runner, loaded):
    """Invariant 7: a seeded random request samples the same tokens alone or in a batch."""
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=8)

    def run(r: ModelRunner, with_neighbour: bool) -> list[int]:
        new = [new_req("s", PROMPT_A, [1], params)]
        num = {"s": len(PROMPT_A)}
        if with_neighbour:
            new.append(new_req("n", PROMPT_B, [2], SamplingParams(temperature=1.0, seed=7)))
            num["n"] = len(PROMPT_B)
        tokens = by_req(step(r, sched(num, new=new)))["s"]
        for i in range(5):
            cached = [("s", [], len(PROMPT_A) + i)]
            num = {"s": 1}
            if with_neighbour:
                cached.append(("n", [], len(PROMPT_B) + i))
                num["n"] = 1
            tokens += by_req(step(r, sched(num, cached=cached)))["s"]
        return tokens

    config, model = loaded
    other = Worker(config)
    other.model = model
    other.initialize_kv_cache(NUM_BLOCKS)
    assert run(runner, False) == run(other.runner, True)


def test_preempted_request_resumes_from_prompt_plus_outputs(runner, hf_greedy):
    """Invariant 1: preemption is finish + re-add with prefill = prompt + outputs so far."""
    first = step(runner, sched({"a": len(PROMPT_A)}, new=[new_req("a", PROMPT_A, [3])]))
    tokens = by_req(first)["a"]
    for i in range(2):
        tokens += by_req(step(runner, sched({"a": 1}, cached=[("a", [], len(PROMPT_A) + i)])))["a"]
    # Preempted: the step carries only the id; the slot is freed.
    runner.execute_model(SchedulerOutput.build(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, preempted_req_ids=["a"]))
    assert runner.sample_tokens(None).req_ids == []
    assert runner.requests.num_active == 0
    # Resumed later on other blocks: the whole history is recomputed, then decoding goes on.
    history = PROMPT_A + tokens
    resumed = NewRequestData(req_id="a", prompt_token_ids=PROMPT_A, prefill_token_ids=history,
                             sampling_params=GREEDY, block_ids=[[9]], num_computed_tokens=0)
    tokens += by_req(step(runner, sched({"a": len(history)}, new=[resumed])))["a"]
    tokens += by_req(step(runner, sched({"a": 1}, cached=[("a", [], len(history))])))["a"]
    assert tokens == hf_greedy(PROMPT_A, 5)


def test_logprobs_match_transformers_log_softmax(runner, tiny_llama):
    """Raw logprobs of the sampled token and the top-5 equal log_softmax of transformers' fp32
    logits at the same positions, within 1e-4; a prefill chunk reports none."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.8, seed=3, logprobs=5, max_tokens=8)
    greedy = SamplingParams(temperature=0.0, logprobs=2, presence_penalty=1.0, max_tokens=8)
    first = step(runner, sched({"a": len(PROMPT_A), "b": 4},
                               new=[new_req("a", PROMPT_A, [1], params),
                                    new_req("b", PROMPT_B, [2], greedy)]))
    assert first.logprobs[1] is None  # b is mid-prefill
    tokens = {"a": list(first.sampled_token_ids[0]), "b": []}
    logprobs = {"a": list(first.logprobs[0]), "b": []}  # one entry per token
    step_out = step(runner, sched({"a": 1, "b": len(PROMPT_B) - 4},
                                  cached=[("a", [], len(PROMPT_A)), ("b", [], 4)]))
    for req_id, toks, lps in zip(step_out.req_ids, step_out.sampled_token_ids,
                                 step_out.logprobs):
        tokens[req_id] += toks
        logprobs[req_id] += lps
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for req_id, prompt, k in (("a", PROMPT_A, 5), ("b", PROMPT_B, 2)):
        seq = prompt + tokens[req_id]
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), dim=-1)
        for i, (token, lp) in enumerate(zip(tokens[req_id], logprobs[req_id])):
            row = ref[len(prompt) - 1 + i]
            assert lp.token_ids[0] == token and len(lp.token_ids) == k + 1
            assert abs(lp.logprobs[0] - row[token].item()) < 1e-4
            assert lp.rank == int((row >= row[token]).sum())
            top = row.topk(k)
            assert lp.token_ids[1:] == top.indices.tolist()
            assert max(abs(a - b) for a, b in zip(lp.logprobs[1:], top.values.tolist())) < 1e-4


def test_penalties_and_bias_through_the_runner(runner, tiny_llama):
    """Greedy with penalties and a bias equals a direct reference on transformers' logits
    (the runner keeps the output counts on the device); allowed ids and min_tokens act on their
    rows in the same batch."""
    from collections import Counter

    from transformers import AutoModelForCausalLM

    from mrv2.models.generation_config import eos_token_ids

    model_config = runner.config.model_config
    eos = eos_token_ids(model_config.hf_config, model_config.model)[0]
    penalised = SamplingParams(temperature=0.0, logit_bias={77: 3.0, 5: -1.0},
                               frequency_penalty=0.7, presence_penalty=0.4,
                               repetition_penalty=1.3, max_tokens=8)
    allowed = SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[5, 6], max_tokens=8)
    no_eos = SamplingParams(temperature=0.0, logit_bias={eos: 100.0}, min_tokens=2,
                            max_tokens=8)
    reqs = [new_req("pen", PROMPT_A, [1], penalised), new_req("allowed", PROMPT_B, [3], allowed),
            new_req("eos", PROMPT_C, [4], no_eos)]
    prompts = {"pen": PROMPT_A, "allowed": PROMPT_B, "eos": PROMPT_C}
    out = by_req(step(runner, sched({r.req_id: len(r.prompt_token_ids) for r in reqs},
                                    new=reqs)))
    tokens = {k: list(v) for k, v in out.items()}
    for i in range(4):
        cached = [(k, [], len(prompts[k]) + i) for k in prompts]
        for k, v in by_req(step(runner, sched({k: 1 for k in prompts}, cached=cached))).items():
            tokens[k] += v
    assert set(tokens["allowed"]) <= {5, 6}
    assert eos not in tokens["eos"][:2] and tokens["eos"][2:] == [eos] * 3

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    seq, expected = list(PROMPT_A), []
    for _ in range(5):
        with torch.no_grad():
            x = model(torch.tensor([seq])).logits[0, -1].double()
        for t, b in penalised.logit_bias.items():
            x[t] += b
        counts = Counter(expected)
        for t in set(PROMPT_A) | set(expected):
            x[t] = x[t] / 1.3 if x[t] > 0 else x[t] * 1.3
        for t, c in counts.items():
            x[t] -= 0.7 * c + 0.4
        expected.append(int(x.argmax()))
        seq.append(expected[-1])
    assert tokens["pen"] == expected
    assert len(set(expected)) > 1  # the penalties did something a plain greedy run may not


def test_warm_up_leaves_no_request_behind(runner):
    """initialize_kv_cache warmed this runner up (every test here runs after it): its dummy
    requests are gone, the sparse sampling tables exist (their stages ran), and the dense
    penalty counts are still unallocated."""
    assert runner.requests.num_active == 0
    assert runner.requests.num_free_slots == runner.requests.max_num_seqs
    assert not runner.prompt_logprobs
    assert runner.sampling.bias.allowed.words is not None
    assert runner.sampling.penalties.output_counts is None


def test_profile_run_makes_the_largest_step_and_leaves_nothing(loaded):
    """A throwaway runner over a one-block cache (as the worker's profile run builds it) runs
    max_num_batched_tokens prompt tokens with the widest sampler tables, then forgets them."""
    config, model = loaded
    worker = Worker(config)
    worker.model = model
    seen = []
    original = ModelRunner.execute_model

    def spy(self, out):
        seen.append(out.total_num_scheduled_tokens)
        return original(self, out)

    ModelRunner.execute_model = spy
    try:
        assert worker.profile_run() == 0  # measured on CUDA only
    finally:
        ModelRunner.execute_model = original
    sched, max_len = config.scheduler_config, config.model_config.max_model_len
    # As many tokens as one step can hold: the budget, or max_num_seqs prompts of a context.
    assert seen[0] == min(sched.max_num_batched_tokens, sched.max_num_seqs * (max_len - 1))
    assert seen[-1] == 0  # the requests were finished
