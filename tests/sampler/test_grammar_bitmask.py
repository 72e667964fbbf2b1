"""The grammar bitmask stage: the torch path against a numpy reference and against xgrammar's
own CPU kernel, the Triton kernel under the interpreter against the torch path, and the
argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.platform import CPU, forced_impl, triton_interpreter
from mrv2.sampler.grammar_bitmask import apply_grammar_bitmask_

# Words with a meaning of their own: none, all, only bit 0, only bit 31 (negative), all but
# bit 31, all but bit 0 (negative).
SPECIAL_WORDS = (0, -1, 1, -2**31, 2**31 - 1, -2)


def reference(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Bit by bit in numpy: token 32 w + b of row i is allowed iff bit b of word w is set."""
    out = logits.numpy().copy()
    vocab = out.shape[1]
    words = bitmask.numpy().view(np.uint32)
    for i, row in enumerate(rows.tolist()):
        for w in range(words.shape[1]):
            for b in range(32):
                t = 32 * w + b
                if t < vocab and not (int(words[i, w]) >> b) & 1:
                    out[row, t] = -np.inf
    return torch.from_numpy(out)


def random_case(batch: int, vocab: int, num_rows: int, seed: int, *, special: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g)
    rows = torch.randperm(batch, generator=g)[:num_rows]
    bitmask = torch.randint(-2**31, 2**31, (num_rows, (vocab + 31) // 32), generator=g,
                            dtype=torch.int32)
    if special:
        choice = torch.randint(0, len(SPECIAL_WORDS), bitmask.shape, generator=g)
        bitmask = torch.tensor(SPECIAL_WORDS, dtype=torch.int32)[choice]
    return logits, rows, bitmask


def applied(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, *,
            triton: bool = False, **kwargs) -> torch.Tensor:
    out = logits.clone()
    if triton:
        with triton_interpreter():
            if kwargs:  # the twin itself, for a block size of the test's choosing
                from mrv2.sampler import grammar_bitmask_triton

                grammar_bitmask_triton.apply_grammar_bitmask_(out, rows, bitmask, **kwargs)
            else:
                apply_grammar_bitmask_(out, rows, bitmask)
    else:
        with forced_impl(CPU):
            apply_grammar_bitmask_(out, rows, bitmask)
    return out


CASES = [  # batch, vocab, constrained rows, seed, special words
    (4, 300, 2, 0, False), (5, 33, 5, 1, False), (3, 1, 3, 2, False), (6, 1000, 3, 3, True),
    (5, 64, 4, 4, True), (8, 257, 1, 5, False), (2, 31, 2, 6, True),
]


@pytest.mark.parametrize("batch, vocab, num_rows, seed, special", CASES)
def test_torch_matches_reference(batch, vocab, num_rows, seed, special) -> None:
    logits, rows, bitmask = random_case(batch, vocab, num_rows, seed, special=special)
    assert torch.equal(applied(logits, rows, bitmask), reference(logits, rows, bitmask))


# xgrammar 0.2.8's CPU kernel masks whole bytes of bits: with V < 8 it writes -inf past the
# row's end (into the next row, or past the tensor), so it is no reference there.
@pytest.mark.parametrize("batch, vocab, num_rows, seed, special",
                         [case for case in CASES if case[1] >= 8]
                         + [(16, 5000, 9, 7, False), (16, 4099, 16, 8, True)])
def test_torch_matches_xgrammar(batch, vocab, num_rows, seed, special) -> None:
    xgrammar = pytest.importorskip("xgrammar")
    logits, rows, bitmask = random_case(batch, vocab, num_rows, seed, special=special)
    # xgrammar's indices pick rows of a batch-sized bitmask: spread ours to those rows.
    full = torch.full((batch, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, full, indices=rows.tolist(), backend="cpu")
    assert torch.equal(applied(logits, rows, bitmask), expected)


def test_special_words() -> None:
    logits = torch.randn(4, 70)
    rows = torch.tensor([3, 0, 1])
    bitmask = torch.tensor([[-1, -1, -1], [0, 0, 0], [-2**31, 1, -2]], dtype=torch.int32)
    out = applied(logits, rows, bitmask)
    assert torch.equal(out[3], logits[3])  # all allowed
    assert torch.isneginf(out[0]).all()  # none allowed
    assert torch.equal(out[2], logits[2])  # not constrained
    kept = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert kept == [31, 32, 65, 66, 67, 68, 69]  # bit 31; bit 0; all but bit 0 (V = 70)
    assert torch.equal(out[1, kept], logits[1, kept])


@pytest.mark.parametrize("triton", [False, True])
def test_no_rows_is_a_no_op(triton: bool) -> None:
    logits = torch.randn(3, 40)
    out = applied(logits, torch.zeros(0, dtype=torch.int64),
                  torch.zeros(0, 2, dtype=torch.int32), triton=triton)
    assert torch.equal(out, logits)


def test_non_contiguous_rows_and_bitmask() -> None:
    logits, rows, bitmask = random_case(6, 100, 3, 9)
    wide = torch.zeros(3, 2 * bitmask.shape[1], dtype=torch.int32)
    wide[:, ::2] = bitmask
    out = applied(logits, rows.repeat_interleave(2)[::2], wide[:, ::2])
    assert torch.equal(out, reference(logits, rows, bitmask))


@pytest.mark.parametrize("batch, vocab, num_rows, seed, special, block", [
    (4, 300, 2, 0, False, None), (5, 33, 5, 1, True, None), (3, 1, 3, 2, False, None),
    (5, 300, 3, 3, True, 64), (5, 257, 4, 4, False, 128), (2, 31, 2, 6, True, 32),
])
def test_triton_matches_torch(batch, vocab, num_rows, seed, special, block) -> None:
    logits, rows, bitmask = random_case(batch, vocab, num_rows, seed, special=special)
    kwargs = {} if block is None else {"block": block}
    expected = applied(logits, rows, bitmask)
    assert torch.equal(applied(logits, rows, bitmask, triton=True, **kwargs), expected)


def _bad_arguments():
    logits, rows, bitmask = torch.zeros(3, 40), torch.tensor([0, 2]), torch.zeros(2, 2,
                                                                                 dtype=torch.int32)
    yield "1-D logits", (logits[0], rows, bitmask)
    yield "float16 logits", (logits.half(), rows, bitmask)
    yield "strided logits", (torch.zeros(3, 80)[:, ::2], rows, bitmask)
    yield "int32 rows", (logits, rows.int(), bitmask)
    yield "2-D rows", (logits, rows.view(2, 1), bitmask)
    yield "int64 bitmask", (logits, rows, bitmask.long())
    yield "too few words", (logits, rows, bitmask[:, :1])
    yield "too many words", (logits, rows, torch.zeros(2, 3, dtype=torch.int32))
    yield "rows != bitmask rows", (logits, rows[:1], bitmask)
    yield "1-D bitmask", (logits, rows[:1], bitmask[0])
    yield "other device", (logits, rows.to("meta"), bitmask)


@pytest.mark.parametrize("args", [pytest.param(a, id=name) for name, a in _bad_arguments()])
def test_bad_arguments_raise(args) -> None:
    with pytest.raises(ValueError):
        apply_grammar_bitmask_(*args)
