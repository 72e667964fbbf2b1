"""Tests of the suffix decoding proposer (mrv2/spec_decode/suffix.py): the rule on small
hand-made histories, caps, resets, stale tokens, the global trie and its eviction, and random
small-vocabulary histories against a brute-force reference that counts continuations of every
earlier occurrence directly."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from mrv2.spec_decode.suffix import SuffixProposer

L = 512  # token_ids row length in these tests


def _ref_best(seqs, ctx, depth, kcap, factor, min_prob):
    """Brute force: (draft, score) of one trie holding the sequences `seqs` (the module
    docstring's rule): every match length, every earlier occurrence counted."""
    n = len(ctx)
    best, best_score = [], 0.0
    for m in range(1, min(depth - 1, n) + 1):
        w = list(ctx[n - m:])
        cap = min(kcap, max(1, int(m * factor + 1e-6)))
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < cap and len(w) < depth:
            size = len(w)
            nxt = Counter(int(seq[e + 1]) for seq in seqs for e in range(size - 1, len(seq) - 1)
                          if list(seq[e - size + 1:e + 1]) == w)
            if not nxt:
                break
            tok, cnt = min(nxt.items(), key=lambda kv: (-kv[1], kv[0]))
            prob *= cnt / sum(nxt.values())
            if prob < min_prob:
                break
            draft.append(tok)
            score += prob
            w.append(tok)
        if draft and score >= best_score:
            best, best_score = draft, score
    return best, best_score


def _ref_propose(ctx, cached, depth, kcap, factor, min_prob):
    own, own_score = _ref_best([list(ctx)], ctx, depth, kcap, factor, min_prob)
    glob, glob_score = _ref_best(cached, ctx, depth, kcap, factor, min_prob)
    return glob if glob and glob_score > own_score else own


def _propose(prop, slots, rows, max_drafts=None, k=None, stale=None):
    """One propose call: rows[i] is the context of slots[i]; positions past it hold `stale`
    (garbage that must be ignored)."""
    k = prop.num_speculative_tokens if k is None else k
    token_ids = np.full((max(slots) + 1, L), -7 if stale is None else stale, np.int32)
    total_len = np.zeros(max(slots) + 1, np.int32)
    for s, row in zip(slots, rows):
        token_ids[s, :len(row)] = row
        total_len[s] = len(row)
    r = len(slots)
    md = np.full(r, k, np.int32) if max_drafts is None else np.asarray(max_drafts, np.int32)
    drafts = np.full((r, k), 99, np.int32)
    num = np.full(r, -1, np.int32)
    prop.propose(np.asarray(slots, np.int64), token_ids, total_len, md, drafts, num)
    for i in range(r):
        assert (drafts[i, num[i]:] == 0).all()
    return [drafts[i, :num[i]].tolist() for i in range(r)]


def _one(prop, ctx, **kw):
    return _propose(prop, [0], [ctx], **kw)[0]


def test_prompt_repetition_is_proposed():
    prop = SuffixProposer(2, 3, max_spec_factor=2.0)
    prop.start(0)
    assert _one(prop, [1, 2, 3, 4, 5, 1, 2]) == [3, 4, 5]
    prop = SuffixProposer(2, 3)  # factor 1: a match of 2 drafts 2
    prop.start(0)
    assert _one(prop, [1, 2, 3, 4, 5, 1, 2]) == [3, 4]
    assert _one(prop, [1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]  # incremental: one more token
    assert _one(prop, [1, 2, 3, 4, 5, 6]) == []  # (a fresh context: rebuilt, no repeat)


def test_caps_and_depth():
    hist = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]
    cases = [  # (K, max_drafts, factor, depth) -> draft
        ((5, 5, 1.0, 24), [5, 6, 7, 8]),  # the match "1 2 3 4" caps at 4
        ((5, 2, 1.0, 24), [5, 6]),
        ((3, 5, 1.0, 24), [5, 6, 7]),
        ((5, 0, 1.0, 24), []),
        ((5, 5, 0.5, 24), [5, 6]),
        ((5, 5, 0.1, 24), [5]),  # at least one token for a match
        ((8, 8, 2.0, 24), [5, 6, 7, 8, 1, 2, 3, 4]),  # stops where the context ends
        ((5, 5, 1.0, 6), [5, 6, 7]),  # depth 6: "2 3 4" (3 more) beats "1 2 3 4" (2 more)
    ]
    for (k, md, factor, depth), want in cases:
        prop = SuffixProposer(1, k, max_tree_depth=depth, max_spec_factor=factor)
        prop.start(0)
        assert _one(prop, hist, max_drafts=[md]) == want, (k, md, factor, depth)
        assert want == _ref_propose(hist, [], depth, min(k, md), factor, 0.1)
    prop = SuffixProposer(1, 8, max_spec_factor=2.0)
    assert _one(prop, hist, k=3) == [5, 6, 7]  # drafts narrower than K


def test_min_token_prob_cuts_rare_branches():
    # "1 2" -> 3 (3 of 4), "1 2 3" -> 5 (2 of 3): the path probability is 3/4, then 1/2
    hist = [1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 1, 2]
    for min_prob, want in ((0.8, []), (0.6, [3]), (0.4, [3, 5, 1, 2])):
        prop = SuffixProposer(1, 4, max_spec_factor=2.0, min_token_prob=min_prob)
        prop.start(0)
        assert _one(prop, hist) == want, min_prob
        assert want == _ref_propose(hist, [], 24, 4, 2.0, min_prob)


def test_start_resets_a_slot():
    prop = SuffixProposer(2, 2)
    prop.start(0)
    prop.start(1)
    assert _propose(prop, [0, 1], [[1, 2, 3, 4, 1, 2], [5, 6, 5]]) == [[3, 4], [6]]
    prop.start(0)  # a new request in slot 0; slot 1 goes on
    assert _propose(prop, [1, 0], [[5, 6, 5, 6, 9], [1, 2, 7, 8, 1, 2]]) == [[], [7, 8]]


def test_tokens_past_total_len_are_ignored():
    prop = SuffixProposer(1, 5, max_spec_factor=2.0)
    prop.start(0)
    # the implicit continuation of "1 2 3" stops where the context does, not at the 4s
    assert _one(prop, [1, 2, 3, 4, 1, 2, 3], stale=4) == [4, 1, 2, 3]
    # stale 9s were never inserted: now position 7 is a real 8
    assert _one(prop, [1, 2, 3, 4, 1, 2, 3, 8, 1, 2, 3], stale=9) == [4, 1, 2, 3, 8]
    hist = [1, 2, 3, 4, 1, 2, 3, 8, 1, 2, 3, 4]
    assert _one(prop, hist, stale=9) == [1, 2, 3, 8, 1] == _ref_propose(hist, [], 24, 5, 2.0, 0.1)


def test_global_tree_helps_a_later_request():
    first = np.array([20, 21, 22, 23, 1, 2, 3, 4, 5, 6], np.int32)  # prompt of 4
    for cached, want in ((10000, [4, 5, 6]), (0, [])):
        prop = SuffixProposer(2, 3, max_cached_requests=cached)
        prop.start(1)
        prop.finish(1, first, 4)
        prop.start(0)
        assert _one(prop, [7, 1, 2, 3]) == want
        prop.start(0)
        assert _one(prop, [20, 21, 22]) == []  # prompts do not join the global trie


def test_own_tree_wins_ties():
    prop = SuffixProposer(2, 2)
    prop.finish(1, np.array([1, 2, 8, 8], np.int32), 0)
    prop.start(0)
    assert _one(prop, [1, 2, 5, 6, 1, 2]) == [5, 6]  # both score 2: the request's own


def test_eviction_past_max_cached_requests():
    outs = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    prop = SuffixProposer(2, 2, max_cached_requests=2)
    for out in outs:
        prop.finish(1, np.array([50] + out, np.int32), 1)
    prop.start(0)
    assert _propose(prop, [0], [[1, 2, 3]]) == [[]]  # the oldest went
    for ctx, want in (([6, 7, 8], [9, 10]), ([11, 12, 13], [14, 15])):
        prop.start(0)
        assert _one(prop, ctx) == want
    # evicting gives every node and edge back: empty outputs push all the others out
    rng = np.random.default_rng(0)
    prop = SuffixProposer(1, 3, max_tree_depth=5, max_cached_requests=2)
    for _ in range(30):
        prop.finish(0, rng.integers(0, 4, rng.integers(0, 40)).astype(np.int32), 0)
    assert prop._global.live_edges() > 0
    for _ in range(2):
        prop.finish(0, np.zeros(3, np.int32), 3)
    assert prop._global.live_edges() == 0
    assert prop._global.live_nodes() == 1  # the root


def test_random_histories_match_brute_force():
    rng = np.random.default_rng(1234)
    for trial in range(12):
        vocab = int(rng.choice([2, 3, 5]))
        depth = int(rng.choice([2, 3, 4, 6]))
        k = int(rng.integers(1, 6))
        factor = float(rng.choice([0.5, 1.0, 2.0]))
        min_prob = float(rng.choice([0.0, 0.1, 0.4]))
        max_cached = int(rng.choice([0, 1, 3]))
        prop = SuffixProposer(3, k, max_tree_depth=depth, max_cached_requests=max_cached,
                              max_spec_factor=factor, min_token_prob=min_prob)
        cached: list[list[int]] = []
        for _ in range(6):  # rounds of two concurrent requests, slots 2 and 0
            ctxs = {s: rng.integers(0, vocab, rng.integers(1, 20)).tolist() for s in (2, 0)}
            prompt = {s: len(c) for s, c in ctxs.items()}
            for s in ctxs:
                prop.start(s)
            for _ in range(int(rng.integers(1, 12))):
                for s in ctxs:
                    ctxs[s] += rng.integers(0, vocab, rng.integers(1, 4)).tolist()
                slots = [2, 0] if rng.random() < 0.5 else [0, 2]
                md = rng.integers(0, k + 1, 2)
                got = _propose(prop, slots, [ctxs[s] for s in slots], max_drafts=md,
                               stale=int(rng.integers(0, vocab)))
                for s, m, g in zip(slots, md, got):
                    want = _ref_propose(ctxs[s], cached, depth, min(k, int(m)), factor,
                                        min_prob)
                    assert g == want, (trial, s, ctxs[s], cached, g, want)
            for s in ctxs:
                prop.finish(s, np.array(ctxs[s], np.int32), prompt[s])
                if max_cached:
                    cached = (cached + [ctxs[s][prompt[s]:]])[-max_cached:]


def test_long_history_step_time():
    """8 rows of 2,000-token histories and a global trie of 40 earlier outputs: the time of a
    decode step (one new token a row), printed (pytest -s)."""
    rng = np.random.default_rng(7)
    rows, k, n0, steps = 8, 5, 2000, 200
    phrases = rng.integers(0, 5000, (64, 12))  # text that repeats phrases, as agents' does

    def text(size):
        out = np.concatenate([phrases[i] if rng.random() < 0.5 else rng.integers(0, 5000, 12)
                              for i in rng.integers(0, 64, size // 12 + 1)])
        return out[:size].astype(np.int32)

    prop = SuffixProposer(rows, k)
    for i in range(40):
        prop.finish(0, text(600), 100)
    token_ids = np.zeros((rows, n0 + steps + 1), np.int32)
    for s in range(rows):
        token_ids[s] = text(token_ids.shape[1])
        prop.start(s)
    total_len = np.full(rows, n0, np.int32)
    slots = np.arange(rows, dtype=np.int64)
    md = np.full(rows, k, np.int32)
    drafts = np.zeros((rows, k), np.int32)
    num = np.zeros(rows, np.int32)
    t0 = time.perf_counter()
    prop.propose(slots, token_ids, total_len, md, drafts, num)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    drafted = 0
    for _ in range(steps):
        total_len += 1
        prop.propose(slots, token_ids, total_len, md, drafts, num)
        drafted += int(num.sum())
    step = (time.perf_counter() - t0) / steps
    print(f"\nsuffix: {rows} rows, first call over {n0}-token histories {first * 1e3:.1f} ms; "
          f"a step {step * 1e6:.0f} us ({step * 1e6 / rows:.1f} us a row); "
          f"{drafted / steps / rows:.2f} drafts a row")
    assert drafted > 0
    assert step < rows * 1e-3  # well under a millisecond a row
