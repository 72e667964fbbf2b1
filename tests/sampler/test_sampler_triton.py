"""The sampler's Triton kernels under TRITON_INTERPRET=1 (CPU tensors) against the torch path.

What must agree, and how (the kernels' docstrings say why):

- noise hash and random bits: bit for bit -> the same token on continuous random logits, for
  many (seed, position) keys, block sizes and vocabularies;
- Gumbel values (``-log(-log(u))``): within 1e-6 (numpy's log vs torch's differ by an ulp);
- bias / allowed ids / min_tokens / penalties: bit for bit under the interpreter (same float
  ops in the same order; a GPU may fuse one multiply-subtract, within float tolerance);
- logprobs: ranks and top-k ids exactly, logprobs within 1e-5 (blockwise logsumexp).
"""

from __future__ import annotations

import pytest
import torch

from mrv2.sampler.bias import apply_allowed_, apply_logit_bias_, apply_min_tokens_
from mrv2.sampler.bias_triton import apply_bias_and_min_tokens_
from mrv2.sampler.logprobs import compute_logprobs
from mrv2.sampler.logprobs_triton import compute_logprobs_triton
from mrv2.sampler.noise import gumbel_noise
from mrv2.sampler.noise_triton import gumbel_block_argmax, gumbel_sample
from mrv2.sampler.penalties import apply_penalties_
from mrv2.sampler.penalties_triton import apply_allowed_and_penalties_
from mrv2.sampler.slot_tables import unpack_token_bits
from mrv2.sampling_params import SamplingParams
from mrv2.platform import triton_interpreter
from sampler_harness import make_batch, random_logits


def seeded(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-(2**63), 2**63 - 1, (n,), generator=g),
            torch.randint(0, 2**40, (n,), generator=g))


@pytest.mark.parametrize("vocab, block", [(300, 64), (1000, 4096), (257, 256)])
def test_gumbel_argmax_matches_torch_noise(vocab: int, block: int) -> None:
    n = 24
    seeds, positions = seeded(n, vocab)
    seeds[:3] = torch.tensor([0, -1, 2**63 - 1])  # sign-bit edge cases of the int64 hash
    idx = torch.arange(n)
    temperature = torch.ones(n)
    x = torch.zeros(n, vocab)
    noise = gumbel_noise(seeds, positions, vocab)
    with triton_interpreter():
        tokens, _ = gumbel_sample(x, idx, temperature, seeds, positions,
                                  apply_temperature=True, block=block)
        row_max, _, _ = gumbel_block_argmax(x, idx, temperature, seeds, positions,
                                         apply_temperature=True,
                                         block=1 << (vocab - 1).bit_length())  # one block
    assert torch.equal(tokens, noise.argmax(-1))
    torch.testing.assert_close(row_max[:, 0], noise.amax(-1), rtol=1e-6, atol=1e-6)


def test_gumbel_sample_temperature_and_greedy_rows() -> None:
    n, vocab = 16, 500
    seeds, positions = seeded(n, 1)
    x = random_logits(n, vocab, seed=1)
    # Slots in another order than rows, greedy slots among them.
    temperature = torch.tensor([0.0, 0.3, 1.0, 2.5] * 4)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    t, s = temperature[idx], seeds[idx]
    expected = torch.where(t == 0, x.argmax(-1),
                           (x / torch.where(t == 0, 1.0, t).unsqueeze(1)
                            + gumbel_noise(s, positions, vocab)).argmax(-1))
    with triton_interpreter():
        fused, _ = gumbel_sample(x, idx, temperature, seeds, positions, apply_temperature=True,
                              block=128)
        prescaled, _ = gumbel_sample(x / torch.where(t == 0, 1.0, t).unsqueeze(1), idx,
                                  temperature, seeds, positions, apply_temperature=False)
    assert torch.equal(fused, expected)
    assert torch.equal(prescaled, expected)


def test_ties_pick_the_lowest_index_across_blocks() -> None:
    x = torch.zeros(2, 300)
    x[0, [70, 200, 250]] = 5.0  # blocks of 64: the tie spans blocks 1, 3 and 3
    x[1, [299, 130]] = 1.0
    with triton_interpreter():
        zeros = torch.zeros(2, dtype=torch.int64)
        tokens, _ = gumbel_sample(x, torch.arange(2), torch.zeros(2), zeros, zeros,
                               apply_temperature=True, block=64)
    assert tokens.tolist() == [70, 130]


PROCESSING = [
    SamplingParams(temperature=0.0, logit_bias={t: 0.5 * t - 3 for t in range(0, 60, 3)},
                   min_tokens=4, stop_token_ids=[5, 99, 250]),
    SamplingParams(allowed_token_ids=list(range(17, 290, 7)), repetition_penalty=1.4),
    SamplingParams(presence_penalty=-1.0, frequency_penalty=0.7, logit_bias={8: 1.0}),
    SamplingParams(temperature=0.0),
    SamplingParams(min_tokens=1, repetition_penalty=0.8, allowed_token_ids=[1, 2, 3, 299]),
    SamplingParams(frequency_penalty=2.0, min_tokens=10),
]


@pytest.mark.parametrize("sparse_block, dense_block", [(4, 64), (128, 1024)])
def test_processing_kernels_equal_torch(sparse_block: int, dense_block: int) -> None:
    vocab = 300
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 40, 1, 9, 3, 60)]
    outputs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (0, 7, 3, 2, 12, 1)]
    batch = make_batch(PROCESSING, vocab, prompts=prompts, outputs=outputs, eos_token_id=7,
                       slots=[4, 0, 5, 2, 1, 3])
    states, idx, positions = batch.states, batch.idx.flip(0), batch.positions.flip(0)
    x = random_logits(len(PROCESSING), vocab, seed=2)

    ref = x.clone()
    bias, pen = states.bias, states.penalties
    apply_allowed_(ref, bias.allowed.words[idx], bias.has_allowed.tensor[idx].bool())
    apply_logit_bias_(ref, bias.bias.ids[idx], bias.bias.values[idx],
                      bias.bias.lengths.tensor[idx])
    apply_min_tokens_(ref, bias.stop_ids.ids[idx], bias.stop_ids.lengths.tensor[idx],
                      positions - states.requests.prompt_len.tensor[idx]
                      < states.min_tokens.tensor[idx])
    apply_penalties_(ref, pen.output_counts[idx],
                     unpack_token_bits(pen.prompt_mask.words[idx], vocab),
                     states.repetition_penalty.tensor[idx], states.presence_penalty.tensor[idx],
                     states.frequency_penalty.tensor[idx])
    assert not torch.equal(ref, x)

    got = x.clone()
    with triton_interpreter():
        apply_bias_and_min_tokens_(got, idx, positions, states, apply_bias=True,
                                   apply_stop=True, block=sparse_block)
        apply_allowed_and_penalties_(got, idx, states, apply_allowed=True,
                                     apply_penalties=True, block=dense_block)
    assert torch.equal(got, ref)


def test_processing_kernels_honour_disabled_stages() -> None:
    vocab = 100
    batch = make_batch(PROCESSING[:3], vocab, outputs=[[4, 4], [1], [8]], eos_token_id=7)
    x = random_logits(3, vocab, seed=3)
    only_bias = x.clone()
    with triton_interpreter():
        apply_bias_and_min_tokens_(only_bias, batch.idx, batch.positions, batch.states,
                                   apply_bias=True, apply_stop=False)
        only_pen = x.clone()
        apply_allowed_and_penalties_(only_pen, batch.idx, batch.states, apply_allowed=False,
                                     apply_penalties=True, block=64)
    changed_bias = (only_bias != x).any(-1).tolist()
    assert changed_bias == [True, False, True]
    assert bool(torch.isfinite(only_bias).all())  # no stop id masked
    assert bool(torch.isfinite(only_pen).all())  # no allowed-ids mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_logits", [False, True])
def test_logprobs_kernel_equals_torch(dtype: torch.dtype, as_logits: bool) -> None:
    x = random_logits(6, 700, seed=4).to(dtype)
    x[1, 100:] = float("-inf")  # whole blocks of filtered tokens
    x[2, ::2] = float("-inf")
    sampled = torch.tensor([0, 5, 1, 699, 350, 64])
    ref = compute_logprobs(x, sampled, 7, as_logits=as_logits)
    with triton_interpreter():
        got = compute_logprobs_triton(x, sampled, 7, as_logits=as_logits, block=128)
    assert torch.equal(got.ranks, ref.ranks)
    assert torch.equal(got.token_ids, ref.token_ids)
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-5)


def check_whole_sampler(mode: str, vocab: int, device: torch.device, *, triton: bool,
                        atol: float) -> None:
    """Every feature on in one mixed batch: the Triton path (interpreted on CPU with
    ``triton``, compiled on a CUDA ``device``) gives the torch path's tokens, ranks and
    sampled ids, and its logprobs within ``atol``."""
    params = [p.clone(temperature=t, seed=i, logprobs=i % 4 * 5)
              for i, (p, t) in enumerate(zip(PROCESSING * 2, [0.0, 0.7, 1.3, 0.0, 0.9, 1.0,
                                                              0.5, 0.0, 1.1, 0.8, 0.0, 2.0]))]
    params[1] = params[1].clone(top_k=40, top_p=0.9)
    params[6] = params[6].clone(min_p=0.05)
    g = torch.Generator().manual_seed(5)
    outputs = [torch.randint(0, vocab, (i % 5,), generator=g).tolist() for i in range(12)]
    logits = random_logits(12, vocab, seed=5)
    ref = make_batch(params, vocab, outputs=outputs, eos_token_id=11).sample(logits, mode=mode)
    batch = make_batch(params, vocab, outputs=outputs, eos_token_id=11, device=device)
    got = batch.sample(logits.to(device), mode=mode, triton=triton)
    assert torch.equal(got.sampled.cpu(), ref.sampled)
    assert torch.equal(got.logprobs.ranks.cpu(), ref.logprobs.ranks)
    assert torch.equal(got.logprobs.token_ids[:, 0].cpu(), ref.logprobs.token_ids[:, 0])
    torch.testing.assert_close(got.logprobs.logprobs.cpu(), ref.logprobs.logprobs, rtol=0,
                               atol=atol)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_whole_sampler_triton_equals_torch(mode: str) -> None:
    check_whole_sampler(mode, 400, torch.device("cpu"), triton=True, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_compiled_sampler_on_cuda_equals_torch_on_cpu(mode: str) -> None:
    """The compiled kernels on a GPU over a 151,936-token vocabulary (many vocab blocks).
    Logprobs within 1e-4: GPU exp/log and a fused multiply-subtract differ by ulps."""
    check_whole_sampler(mode, 151_936, torch.device("cuda"), triton=False, atol=1e-4)


def test_triton_seeded_rows_are_batch_invariant() -> None:
    vocab = 300
    params = [SamplingParams(temperature=0.9, seed=100 + i, top_k=[0, 20][i % 2],
                             presence_penalty=0.5 * (i % 3)) for i in range(6)]
    logits = random_logits(6, vocab, seed=6)
    together = make_batch(params, vocab).sample(logits, triton=True).sampled
    for i in range(6):
        alone = make_batch([params[i]], vocab).sample(logits[i:i + 1], triton=True).sampled
        assert alone.item() == together[i].item()
    perm = [3, 5, 0, 1, 4, 2]
    shuffled = make_batch([params[i] for i in perm], vocab, slots=[9, 2, 7, 0, 4, 5],
                          num_slots=10).sample(logits[perm], triton=True).sampled
    assert torch.equal(shuffled, together[perm])
