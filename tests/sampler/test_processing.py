"""Logit bias, allowed_token_ids, min_tokens and the penalties, each against a direct
per-token reference computation, through the sampler as the runner calls it.

With a 20-token vocabulary, ``logprobs=20`` in ``processed_logits`` mode returns every
token's processed logit, so a greedy row exposes its whole processed row for comparison."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from mrv2.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from sampler_harness import make_batch, random_logits

V = 20
EOS = 2


def reference_row(logits: list[float], params: SamplingParams, prompt: list[int],
                  outputs: list[int], eos: int | None = EOS) -> list[float]:
    """The processed logits of one row, token by token (float64)."""
    x = list(logits)
    if params.allowed_token_ids is not None:
        x = [v if t in params.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    if len(outputs) < params.min_tokens:
        stops = set(params.stop_token_ids or [])
        if eos is not None and not params.ignore_eos:
            stops.add(eos)
        for t in stops:
            x[t] = -math.inf
    counts = Counter(outputs)
    for t in range(len(x)):
        if t in prompt or counts[t]:
            r = params.repetition_penalty
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= params.frequency_penalty * counts[t]
        x[t] -= params.presence_penalty * (counts[t] > 0)
    return x


def processed_rows(out, num_rows: int) -> torch.Tensor:
    """Scatter the (sampled + top-20) processed logits back into [rows, V]."""
    full = torch.full((num_rows, V), float("nan"))
    full.scatter_(1, out.logprobs.token_ids[:, 1:], out.logprobs.logprobs[:, 1:])
    return full


PARAMS = {
    "bias": SamplingParams(temperature=0.0, logit_bias={3: 5.0, 7: -2.5, 19: 0.25}),
    "allowed": SamplingParams(temperature=0.0, allowed_token_ids=[4, 5, 11, 2]),
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6, 13]),
    "min_tokens_ignore_eos": SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True,
                                            stop_token_ids=[6]),
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=1.7),
    "repetition_below_1": SamplingParams(temperature=0.0, repetition_penalty=0.6),
    "presence": SamplingParams(temperature=0.0, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=0.0, frequency_penalty=-0.75),
    "everything": SamplingParams(temperature=0.0, logit_bias={5: 1.0, 8: -1.0},
                                 allowed_token_ids=list(range(3, 15)), min_tokens=2,
                                 stop_token_ids=[9], repetition_penalty=1.3,
                                 presence_penalty=0.4, frequency_penalty=0.3),
    "plain": SamplingParams(temperature=0.0),
}
PROMPT = [1, 4, 4, 9, 12]
OUTPUTS = [5, 12, 5, 17]  # already produced (a resumed request); 5 twice


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("num_outputs", [0, 2, 4])
def test_each_feature_matches_reference(num_outputs: int, triton: bool) -> None:
    names = list(PARAMS)
    params = [PARAMS[n].clone(logprobs=20) for n in names]
    outputs = OUTPUTS[:num_outputs]
    batch = make_batch(params, V, prompts=[PROMPT] * len(names),
                       outputs=[outputs] * len(names), eos_token_id=EOS)
    logits = random_logits(len(names), V, seed=num_outputs)
    out = batch.sample(logits, mode="processed_logits", triton=triton)
    got = processed_rows(out, len(names))
    for row, name in enumerate(names):
        expected = torch.tensor(reference_row(logits[row].tolist(), params[row], PROMPT,
                                              outputs), dtype=torch.float32)
        torch.testing.assert_close(got[row], expected, rtol=1e-6, atol=1e-6,
                                   msg=f"{name}: processed logits differ")
        assert out.sampled[row].item() == int(expected.argmax()), name


@pytest.mark.parametrize("name", list(PARAMS))
def test_each_feature_alone_matches_reference(name: str) -> None:
    """A batch where only this feature is on (the others' stages are skipped)."""
    params = PARAMS[name].clone(logprobs=20)
    batch = make_batch([params], V, prompts=[PROMPT], outputs=[OUTPUTS], eos_token_id=EOS)
    logits = random_logits(1, V, seed=7)
    got = processed_rows(batch.sample(logits, mode="processed_logits"), 1)[0]
    expected = reference_row(logits[0].tolist(), params, PROMPT, OUTPUTS)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_output_counts_follow_sampled_tokens(triton: bool) -> None:
    """Several decode steps: post_update counts each sampled token once; a row whose prefill
    is incomplete (position < prefill length) counts nothing."""
    params = [PARAMS["everything"].clone(logprobs=20, temperature=0.9, seed=s) for s in (1, 2)]
    params.append(SamplingParams(temperature=0.0, frequency_penalty=0.8, logprobs=20))
    prompts = [PROMPT, PROMPT[:3], [7, 7, 8]]
    outputs = [[5], [], []]
    batch = make_batch(params, V, prompts=prompts, outputs=outputs, eos_token_id=EOS)
    states = batch.states
    produced = [list(o) for o in outputs]
    positions = torch.tensor([6, 3, 1])  # row 2 is one token into its 3-token prefill
    for step in range(5):
        batch.positions = positions.clone()
        logits = random_logits(3, V, seed=100 + step)
        out = batch.sample(logits, mode="processed_logits", triton=triton)
        got = processed_rows(out, 3)
        for row in range(2):  # sampling rows: temperature-scaled processed logits
            ref = reference_row(logits[row].tolist(), params[row], prompts[row], produced[row])
            expected = torch.tensor(ref, dtype=torch.float32) / 0.9
            torch.testing.assert_close(got[row], expected, rtol=1e-5, atol=1e-5)
        states.post_update(batch.idx, batch.idx.numpy(), batch.positions, out.sampled)
        for row in range(3):
            if positions[row] >= len(prompts[row]) + len(outputs[row]):
                produced[row].append(out.sampled[row].item())
        positions += 1
    counts = states.penalties.output_counts
    for row in range(3):
        expected = torch.bincount(torch.tensor(produced[row] or [0]), minlength=V)
        if not produced[row]:
            expected.zero_()
        assert counts[row].tolist() == expected.tolist(), row
    # Row 2 finished its prefill at position 3: it sampled at positions 3, 4 and 5.
    assert len(produced[2]) == 3


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_logit_bias_of_1024_entries_matches_reference(triton: bool) -> None:
    """A full-width bias (MAX_LOGIT_BIAS entries) next to a short one in the widened table:
    each row's top-20 processed logits and its greedy token against ``logits + bias``; the
    short row's unused table entries change nothing."""
    vocab = 3000
    g = torch.Generator().manual_seed(8)
    ids = torch.randperm(vocab, generator=g)[:MAX_LOGIT_BIAS].tolist()
    values = (torch.rand(MAX_LOGIT_BIAS, generator=g) * 20 - 10).tolist()
    params = [SamplingParams(temperature=0.0, logprobs=20, logit_bias={ids[0]: 7.0, 11: -3.0}),
              SamplingParams(temperature=0.0, logprobs=20, logit_bias=dict(zip(ids, values))),
              SamplingParams(temperature=0.0, logprobs=20)]
    batch = make_batch(params, vocab, slots=[2, 0, 1])
    assert batch.states.bias.bias.width == MAX_LOGIT_BIAS
    logits = random_logits(3, vocab, seed=8)
    out = batch.sample(logits, mode="processed_logits", triton=triton)
    for row, p in enumerate(params):
        expected = logits[row].double()
        for t, b in (p.logit_bias or {}).items():
            expected[t] += b
        top = expected.topk(20)
        assert out.logprobs.token_ids[row, 1:].tolist() == top.indices.tolist(), row
        torch.testing.assert_close(out.logprobs.logprobs[row, 1:].double(), top.values,
                                   rtol=0, atol=1e-5)
        assert out.sampled[row].item() == int(expected.argmax())
    assert len(set(out.logprobs.token_ids[1, 1:].tolist()) & set(ids)) >= 15  # bias decides


def test_min_tokens_blocks_eos_until_reached() -> None:
    """EOS dominates the logits; it is never sampled while outputs < min_tokens."""
    params = SamplingParams(temperature=1.0, min_tokens=3, seed=5)
    logits = torch.zeros(1, V)
    logits[0, EOS] = 30.0
    prompt = [1, 2, 3, 4]
    for num_output in range(5):
        batch = make_batch([params], V, prompts=[prompt], eos_token_id=EOS,
                           positions=[len(prompt) + num_output])
        token = batch.sample(logits).sampled.item()
        assert (token == EOS) == (num_output >= 3), num_output
    # Without a model EOS, the request's own EOS (a tokenizer-only one) is masked.
    batch = make_batch([params], V, prompts=[prompt], eos_token_id=None,
                       positions=[len(prompt)])
    assert batch.sample(logits).sampled.item() == EOS
    batch.states.add(0, "own-eos", params, prompt, eos_token_id=EOS)
    batch.states.apply_staged_writes()
    assert batch.sample(logits).sampled.item() != EOS


def test_allowed_token_ids_restrict_random_sampling() -> None:
    allowed = [0, 3, 17, 19]
    params = SamplingParams(temperature=1.5, allowed_token_ids=allowed)
    n = 2000
    batch = make_batch([params], V, idx=[0] * n, positions=torch.arange(n))
    logits = random_logits(1, V, seed=3).expand(n, -1)
    tokens = batch.sample(logits).sampled
    assert set(tokens.tolist()) == set(allowed)


def test_logit_bias_moves_the_greedy_token() -> None:
    logits = random_logits(1, V, seed=4)
    low = int(logits[0].argmin())
    batch = make_batch([SamplingParams(temperature=0.0, logit_bias={low: 100.0})], V)
    assert batch.sample(logits).sampled.item() == low


def test_penalty_tables_do_not_leak_between_requests() -> None:
    """A slot reused by a request without penalties samples as if the table did not exist,
    and one reused by a request with penalties starts from its own counts."""
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=20)
    batch = make_batch([params, SamplingParams(temperature=0.0, logprobs=20)], V,
                       prompts=[[1], [1]], outputs=[[3, 3, 4], [5]])
    states = batch.states
    logits = random_logits(2, V, seed=9)
    states.post_update(batch.idx, batch.idx.numpy(), batch.positions,
                       torch.tensor([6, 6]))
    # Slot 0 gets a new request with penalties and other outputs; slot 1 keeps garbage counts.
    states.add(0, "new", params, [2], [2, 8])
    states.apply_staged_writes()
    batch.positions = torch.tensor([2, 2])
    out = batch.sample(logits, mode="processed_logits")
    got = processed_rows(out, 2)
    torch.testing.assert_close(got[0], torch.tensor(
        reference_row(logits[0].tolist(), params, [2], [8]), dtype=torch.float32))
    torch.testing.assert_close(got[1], logits[1])
    assert states.penalties.output_counts[0].nonzero().flatten().tolist() == [8]


def test_reference_is_not_trivial() -> None:
    """Every feature in PARAMS changes at least one logit of its row."""
    logits = random_logits(1, V, seed=0)[0].tolist()
    for name, params in PARAMS.items():
        ref = reference_row(logits, params, PROMPT, OUTPUTS[:2])
        changed = not np.allclose(ref, logits)
        assert changed == (name != "plain"), name
