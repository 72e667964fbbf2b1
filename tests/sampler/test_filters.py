"""top-k / top-p by threshold search (radix select) against the sort-based reference they
replace (filters_helpers.py): the same tokens kept, row for row, including ties, -inf tokens,
mixed on/off rows, skipped rows and the topk branch."""

from __future__ import annotations

import pytest
import torch

from filters_helpers import reference_top_k_top_p_
from mrv2.sampler import filters
from mrv2.sampler.filters import apply_top_k_top_p_
from mrv2.sampler.radix_select import keys_to_values, select_threshold, sortable_keys


@pytest.fixture(autouse=True, params=["search", "sort"])
def small_vocab_path(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tests' small vocabularies take the search too (``search``), or the sort below
    MIN_SEARCH_VOCAB as in production (``sort``)."""
    if request.param == "search":
        monkeypatch.setattr(filters, "MIN_SEARCH_VOCAB", 0)
    return request.param


def _rows(seed: int, rows: int = 24, vocab: int = 700) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[::3] = x[::3].round()  # many ties
    x[1::4, ::5] = float("-inf")  # already filtered tokens
    x[2, :] = 0.5  # a constant row
    k = torch.randint(1, 40, (rows,), generator=g)
    k[::5] = torch.tensor([0, -1, vocab, vocab + 3, vocab - 1])[: len(k[::5])]
    p = torch.rand(rows, generator=g) * 0.98 + 0.01
    p[::6] = 1.0
    return x, k, p


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stages", ["k", "p", "kp"])
def test_same_tokens_as_the_sort(seed: int, stages: str) -> None:
    x, k, p = _rows(seed)
    top_k = k if "k" in stages else None
    top_p = p if "p" in stages else None
    skip = torch.zeros(len(x), dtype=torch.bool)
    skip[7] = True
    expected = reference_top_k_top_p_(x.clone(), top_k, top_p, skip_rows=skip)
    got = apply_top_k_top_p_(x.clone(), top_k, top_p, skip_rows=skip)
    assert torch.equal(got.isinf(), expected.isinf())
    assert torch.equal(got, expected)


def test_partial_sort_branch_matches_search() -> None:
    x, k, p = _rows(9)
    bounded = torch.randint(1, 40, (len(x),))
    searched = apply_top_k_top_p_(x.clone(), bounded, p)
    partial = apply_top_k_top_p_(x.clone(), bounded, p, max_top_k=int(bounded.max()))
    assert torch.equal(searched, partial)


def test_top_p_zero_keeps_the_top_tokens_and_nan_reads_as_minus_inf(small_vocab_path: str
                                                                     ) -> None:
    if small_vocab_path == "sort":
        pytest.skip("the sort orders NaN first; only the search reads it as -inf")
    x = torch.tensor([[1.0, 3.0, 3.0, float("nan"), -2.0]])
    out = apply_top_k_top_p_(x.clone(), None, torch.tensor([0.0]))
    assert out[0, :3].tolist() == [float("-inf"), 3.0, 3.0]
    out = apply_top_k_top_p_(x.clone(), torch.tensor([3]), None)
    assert out[0, [0, 1, 2, 4]].tolist() == [1.0, 3.0, 3.0, float("-inf")]


def test_radix_select_is_the_kth_value() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 300, generator=g)
    x[0, :5] = -0.0
    x[0, 5:10] = 0.0
    k = torch.randint(1, 300, (8,), generator=g)
    keys = sortable_keys(x)
    assert torch.equal(keys_to_values(keys), x + 0.0)
    key, above = select_threshold(keys, torch.ones_like(x), k.float())
    expected = x.sort(dim=1, descending=True).values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    assert torch.equal(keys_to_values(key), expected + 0.0)
    assert torch.equal(above, (x > expected.unsqueeze(1)).sum(1).float())


_NEEDS_CUDA = [pytest.mark.cuda,
               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_NEEDS_CUDA)])
def test_whole_row_thresholds_sort_on_a_gpu(small_vocab_path: str, device: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a small top-k bound the CPU searches from MIN_SEARCH_VOCAB up, and a GPU
    always sorts (torch's segmented sort measured faster there at 151,936 tokens)."""
    calls: list[str] = []
    for name in ("_searched_threshold", "_partial_sort_threshold"):
        original = getattr(filters, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(filters, name, spy)
    x, _, p = _rows(0)
    expected = reference_top_k_top_p_(x.clone(), None, p)
    got = apply_top_k_top_p_(x.to(device), None, p.to(device)).cpu()
    searched = device == "cpu" and small_vocab_path == "search"
    assert calls == ["_searched_threshold" if searched else "_partial_sort_threshold"]
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
