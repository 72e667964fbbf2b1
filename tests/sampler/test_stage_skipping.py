"""What work a batch does: a stage that no row of the batch uses is never called (decided on the
host from the states' mirrors), no dense ``[max_num_seqs, vocab]`` table exists while no request
uses penalties, and logprobs are computed per row tile, never through a ``[batch, vocab]``
log-softmax.

Every "not called" check has a positive control: the same patched function is called once a
row uses its stage, so a wrong patch target cannot make a test pass."""

from __future__ import annotations

from collections import Counter
from types import ModuleType

import numpy as np
import pytest
import torch

import mrv2.sampler.sampler_torch as torch_path
import mrv2.sampler.sampler_triton as triton_path
from mrv2.sampler import Sampler
from mrv2.sampling_params import SamplingParams
from sampler_harness import make_batch, new_states, random_logits

V = 300
EOS = 2
# Stage -> (the function sampler_torch calls for it, parameters that turn it on).
STAGES = {
    "allowed": ("apply_allowed_", dict(allowed_token_ids=[1, 5, 9, 40])),
    "logit_bias": ("apply_logit_bias_", dict(logit_bias={4: 1.0})),
    "min_tokens": ("apply_min_tokens_", dict(min_tokens=3, stop_token_ids=[7])),
    "penalties": ("apply_penalties_", dict(presence_penalty=0.5)),
    "min_p": ("apply_min_p_", dict(min_p=0.05)),
    "top_k_top_p": ("apply_top_k_top_p_", dict(top_k=5)),
    "logprobs": ("compute_logprobs", dict(logprobs=2)),
}


def count_calls(monkeypatch: pytest.MonkeyPatch, module: ModuleType, names: list[str],
                kwargs_log: dict[str, list[dict]] | None = None) -> Counter:
    """Wrap ``module.<name>`` so each call is counted (and its keyword arguments logged)."""
    counts: Counter = Counter()
    for name in names:
        original = getattr(module, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            if kwargs_log is not None:
                kwargs_log.setdefault(_name, []).append(kwargs)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return counts


def random_params(i: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=i, **kwargs)


@pytest.mark.parametrize("stage", list(STAGES))
def test_torch_path_skips_a_stage_no_row_uses(stage: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    functions = [fn for fn, _ in STAGES.values()]
    counts = count_calls(monkeypatch, torch_path, functions + ["gumbel_noise"])
    others = [random_params(i, **kw) for i, (name, (_, kw)) in enumerate(STAGES.items())
              if name != stage] + [SamplingParams(temperature=0.0)]
    logits = random_logits(len(others) + 1, V, seed=1)
    make_batch(others, V, eos_token_id=EOS).sample(logits[:len(others)])
    fn, enable = STAGES[stage]
    assert counts[fn] == 0, f"{fn} ran although no row uses {stage}"
    assert all(counts[f] > 0 for f in functions if f != fn)  # the others did run
    counts.clear()
    with_stage = others + [random_params(99, **enable)]
    make_batch(with_stage, V, eos_token_id=EOS).sample(logits)
    assert counts[fn] > 0  # positive control


def test_torch_path_greedy_batch_draws_no_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = count_calls(monkeypatch, torch_path, ["gumbel_noise", "apply_top_k_top_p_"])
    logits = random_logits(4, V, seed=2)
    greedy = [SamplingParams(temperature=0.0, top_k=5), SamplingParams(top_k=1),
              SamplingParams(temperature=0.0, logit_bias={3: 1.0})]
    make_batch(greedy, V).sample(logits[:3])
    assert counts == Counter()  # greedy rows ignore their filters and draw no noise
    make_batch(greedy + [random_params(1)], V).sample(logits)
    assert counts["gumbel_noise"] == 1


def test_triton_path_skips_unused_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    log: dict[str, list[dict]] = {}
    names = ["apply_bias_and_min_tokens_", "apply_allowed_and_penalties_", "_scale_and_filter_",
             "gumbel_sample", "compute_logprobs_triton"]
    counts = count_calls(monkeypatch, triton_path, names, log)
    logits = random_logits(len(STAGES), V, seed=3)

    def run(params: list[SamplingParams]) -> Counter:
        counts.clear()
        log.clear()
        make_batch(params, V, eos_token_id=EOS).sample(logits[:len(params)], triton=True)
        return Counter(counts)

    # Greedy only: the argmax fast path, no kernel at all.
    assert run([SamplingParams(temperature=0.0)] * 2) == Counter()
    # Plain temperature: only the fused temperature + Gumbel kernel.
    assert run([random_params(1), SamplingParams(temperature=0.0)]) == Counter(gumbel_sample=1)
    # Logit bias only: the sparse kernel with the stop-id part off; no dense kernel.
    assert run([random_params(1, logit_bias={4: 1.0})]) == Counter(
        apply_bias_and_min_tokens_=1, gumbel_sample=1)
    assert log["apply_bias_and_min_tokens_"] == [dict(apply_bias=True, apply_stop=False)]
    # Penalties only: the dense kernel with the allowed-ids part off.
    assert run([random_params(1, presence_penalty=0.5)]) == Counter(
        apply_allowed_and_penalties_=1, gumbel_sample=1)
    assert log["apply_allowed_and_penalties_"] == [dict(apply_allowed=False, apply_penalties=True)]
    # Everything on: every stage runs once (positive control).
    every = [random_params(i, **kw) for i, (_, kw) in enumerate(STAGES.values())]
    assert run(every) == Counter({name: 1 for name in names})


@pytest.mark.parametrize("module", [torch_path, triton_path], ids=["torch", "triton"])
def test_top_k_bound_reaches_the_filter(module: ModuleType,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths pass the batch's largest top-k (0 when a row filters by top-p alone) to
    apply_top_k_top_p_, so small bounds take torch.topk rather than a whole-row threshold."""
    log: dict[str, list[dict]] = {}
    count_calls(monkeypatch, module, ["apply_top_k_top_p_"], log)
    logits = random_logits(3, V, seed=4)
    triton = module is triton_path
    bounded = [random_params(1, top_k=5), random_params(2, top_k=7, top_p=0.9)]
    make_batch(bounded, V).sample(logits[:2], triton=triton)
    make_batch(bounded + [random_params(3, top_p=0.5)], V).sample(logits, triton=triton)
    assert [kwargs["max_top_k"] for kwargs in log["apply_top_k_top_p_"]] == [7, 0]


def _reachable_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor held (directly or through mrv2 objects, lists, tuples and dicts) by
    ``root``."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("mrv2.") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return found


def test_no_dense_vocab_table_while_no_request_uses_penalties() -> None:
    """Several steps with every feature but the penalties: no table of the states or the
    sampler reaches ``max_num_seqs * vocab / 8`` elements (the allowed-ids bitmask is
    ``vocab / 32`` words per slot). The first request with a penalty allocates the counts."""
    num_slots, vocab = 32, 50_000
    states = new_states(num_slots, vocab, eos_token_ids=(EOS,))
    kinds = [dict(temperature=0.0), dict(top_k=20, top_p=0.9, min_p=0.01),
             dict(logit_bias={5: 2.0, 9: -1.0}), dict(allowed_token_ids=list(range(0, vocab, 7))),
             dict(min_tokens=4, stop_token_ids=[11]), dict(logprobs=5)]
    for slot in range(num_slots):
        states.add(slot, f"r{slot}", SamplingParams(seed=slot, **kinds[slot % len(kinds)]),
                   [1, 2, 3])
    states.apply_staged_writes()
    sampler = Sampler(states)
    idx_np = np.random.default_rng(0).permutation(num_slots)
    idx = torch.from_numpy(idx_np)
    positions = torch.full((num_slots,), 3, dtype=torch.int64)
    logits = random_logits(num_slots, vocab, seed=4)
    limit = num_slots * vocab // 8

    def biggest() -> int:
        return max(t.numel() for t in _reachable_tensors(sampler))

    for _ in range(3):
        out = sampler(logits, idx, idx_np, positions)
        states.post_update(idx, idx_np, positions, out.sampled)
        positions += 1
        assert states.penalties.output_counts is None
        assert biggest() < limit
    states.add(0, "pen", SamplingParams(repetition_penalty=1.2), [1, 2, 3])
    states.apply_staged_writes()
    assert biggest() == num_slots * vocab  # positive control: the walk finds the counts


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "mixed"])
def test_logprobs_per_tile_without_log_softmax(mode: str, greedy: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Logprobs are computed on row tiles (at most ``TILE_ELEMS / vocab`` rows at once), and
    no log-softmax or softmax over the logits is ever taken."""
    monkeypatch.setattr(torch_path, "TILE_ELEMS", 4 * V)  # 4 rows per tile
    rows_per_call: list[int] = []
    original = torch_path.compute_logprobs

    def record(source: torch.Tensor, *args, **kwargs):
        rows_per_call.append(source.shape[0])
        return original(source, *args, **kwargs)

    monkeypatch.setattr(torch_path, "compute_logprobs", record)

    def forbidden(*args, **kwargs):
        raise AssertionError("a [batch, vocab] (log-)softmax was computed")

    for owner in (torch, torch.nn.functional, torch.Tensor):
        for name in ("log_softmax", "softmax"):
            monkeypatch.setattr(owner, name, forbidden)
    n = 11
    params = [SamplingParams(temperature=0.0 if greedy or i % 3 == 0 else 0.9, seed=i,
                             top_k=0 if greedy else 20, logprobs=i % 4 * 5)
              for i in range(n)]
    out = make_batch(params, V).sample(random_logits(n, V, seed=5), mode=mode)
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (n, 16)
    assert rows_per_call and max(rows_per_call) <= 4 and sum(rows_per_call) == n
