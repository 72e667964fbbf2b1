"""Suffix decoding draft proposer: vLLM's speculative method "suffix", after Snowflake's
arctic-inference SuffixDecoding, on the CPU (the tries' kernels are in suffix_numba.py).

Two kinds of depth-bounded suffix trie (every substring of length <= max_tree_depth, with
occurrence counts): one per request over its context (prompt then outputs), extended
incrementally by each `propose`, and one global trie over the outputs of the last
`max_cached_requests` finished requests (a request's outputs join it at `finish`; the oldest
is evicted past that many; 0 disables it).

Proposal, per row with context c of n tokens and cap = min(K, max_drafts[r]): for each trie
and each match length m = 1 .. min(max_tree_depth - 1, n) whose suffix c[n-m:] has an earlier
occurrence, the draft follows the most frequent continuation (ties: the smaller token id)
while the path probability -- the product of count(child) / out(parent), out being the
parent's occurrences that have a next token -- stays >= min_token_prob, for at most
min(cap, max(1, floor(max_spec_factor * m))) tokens and within the trie's depth. The score of
a draft is the sum of its tokens' path probabilities. A trie keeps its best-scoring draft
(ties: the longer match) -- not the longest match's alone: a match near the depth bound has
little depth left to draft from -- and the global trie's is used only when it scores strictly
higher than the request's own. No match: no draft; drafts[r, num_drafts[r]:] is 0.

As arctic-inference's path speculation (which vLLM calls), with these differences, each
deterministic: the request's trie never counts the current suffix as its own earlier
occurrence (probabilities divide by out(w), not count(w), so the occurrence that ends a
sequence dilutes nothing); ties between children go to the smaller token id; a match of any
length may draft one token; outputs join the global trie when the request finishes.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from mrv2.spec_decode.suffix_numba import (
    _EDGE_COLS,
    _M_EDGES,
    _M_FREE_EDGE,
    _M_FREE_NODE,
    _M_LIVE_EDGES,
    _M_NODES,
    _M_SEEN,
    _META_LEN,
    _N_DEPTH,
    _NODE_COLS,
    extend,
    propose_row,
    rehash,
    remove_seq,
    shift_leaves,
)

_FIRST_CAP = 256  # rows a new trie starts with (a short request stays small)


def _fresh_active(depth: int) -> np.ndarray:
    """extend's suffix nodes of an empty sequence: the root, then none."""
    active = np.full(depth + 1, -1, np.int32)
    active[0] = 0
    return active


def _grown(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.empty((rows,) + a.shape[1:], a.dtype)
    out[: a.shape[0]] = a
    return out


class _Trie:
    """One trie's arrays (suffix_numba.py's layout) and their growth."""

    def __init__(self, depth: int, cap: int = _FIRST_CAP) -> None:
        self.depth = depth
        cap = max(cap, 2 * depth + 2)
        self.nodes = np.empty((cap, _NODE_COLS), np.int32)
        self.nodes[0] = (0, 0, 0, -1, 0, -1)  # the root: no count kept, no children yet
        self.edges = np.empty((cap, _EDGE_COLS), np.int32)
        self.table = np.full(1 << (2 * cap - 1).bit_length(), -1, np.int32)
        self.meta = np.zeros(_META_LEN, np.int64)
        self.meta[_M_NODES] = 1
        self.meta[_M_FREE_NODE] = self.meta[_M_FREE_EDGE] = -1
        self.active = _fresh_active(depth)  # the request's trie: its context's suffix nodes

    def grow(self) -> None:
        """Make room for extend's next token (at most depth nodes and edges), doubling."""
        need = self.depth + 1
        if self.meta[_M_NODES] + need > self.nodes.shape[0]:
            self.nodes = _grown(self.nodes, 2 * self.nodes.shape[0] + need)
        if self.meta[_M_EDGES] + need > self.edges.shape[0]:
            self.edges = _grown(self.edges, 2 * self.edges.shape[0] + need)
        size = self.table.shape[0]
        while 2 * (self.meta[_M_LIVE_EDGES] + need) > size:  # the table stays <= half full
            size *= 2
        if size != self.table.shape[0]:
            self.table = np.full(size, -1, np.int32)
            rehash(self.table, self.edges, self.meta[_M_EDGES])

    def insert(self, seq: np.ndarray, start: int, end: int, active: np.ndarray) -> None:
        """extend with seq[start:end], growing the arrays as it needs."""
        p = start
        while p < end:
            p = extend(self.nodes, self.edges, self.table, self.meta, active, seq, p, end,
                       self.depth)
            if p < end:
                self.grow()

    def live_edges(self) -> int:
        return int(self.meta[_M_LIVE_EDGES])

    def live_nodes(self) -> int:
        """Nodes in use, the root included (free nodes have depth -1)."""
        return int((self.nodes[: self.meta[_M_NODES], _N_DEPTH] >= 0).sum())


class SuffixProposer:
    """Suffix decoding drafts for up to max_num_seqs slots (see the module docstring)."""

    def __init__(self, max_num_seqs: int, num_speculative_tokens: int, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        if max_tree_depth < 1 or num_speculative_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs, num_speculative_tokens and max_tree_depth must be "
                             ">= 1")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests  # 0: no global trie; < 0: no limit
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        # None: no request in the slot (or it finished); `propose` then starts one
        self._own: list[_Trie | None] = [None] * max_num_seqs
        self._global = _Trie(max_tree_depth)
        # The global trie's sequences, each followed by a -1 sentinel (a leaf edge's implicit
        # path stops there); [_pool_start, _pool_len) is live, the prefix was evicted.
        self._pool = np.full(1024, -1, np.int32)
        self._pool_len = 0
        self._pool_start = 0
        self._cached: deque[tuple[int, int]] = deque()  # (start, end) in the pool, oldest first

    def start(self, slot: int) -> None:
        """A new request takes `slot` (its per-request tree starts empty)."""
        self._own[slot] = _Trie(self.max_tree_depth)

    def finish(self, slot: int, token_ids: np.ndarray, prompt_len: int) -> None:
        """The request in `slot` ended; its outputs token_ids[prompt_len:] join the global
        trie (when max_cached_requests != 0), evicting the oldest cached request past
        max_cached_requests."""
        self._own[slot] = None  # its trie's memory goes now, not at the slot's next start
        if self.max_cached_requests == 0:
            return
        out = np.asarray(token_ids)[prompt_len:]
        self._reserve_pool(out.shape[0] + 1)
        a = self._pool_len
        b = a + out.shape[0]
        self._pool[a:b] = out
        self._pool[b] = -1
        self._global.insert(self._pool, a, b, _fresh_active(self.max_tree_depth))
        self._pool_len = b + 1
        self._cached.append((a, b))
        g = self._global
        while 0 < self.max_cached_requests < len(self._cached):
            a, b = self._cached.popleft()
            remove_seq(g.nodes, g.edges, g.table, g.meta, self._pool, a, b, self.max_tree_depth)
            self._pool_start = b + 1
        if 2 * self._pool_start > self._pool_len:  # mostly dead: move the live part down
            self._compact()

    def propose(self, slots: np.ndarray, token_ids: np.ndarray, total_len: np.ndarray,
                max_drafts: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray) -> None:
        """For each row r: slot s = slots[r], context token_ids[s, :total_len[s]] (tokens at
        or past total_len[s] are ignored); write up to min(K, max_drafts[r]) draft tokens into
        drafts[r] (the rest 0) and their count into num_drafts[r]."""
        g = self._global
        k = min(self.num_speculative_tokens, drafts.shape[1])
        for r in range(slots.shape[0]):
            s = int(slots[r])
            n = int(total_len[s])
            trie = self._own[s]
            # not started, or the context shrank (only `start` may reset it): from scratch
            if trie is None or n < trie.meta[_M_SEEN]:
                trie = self._own[s] = _Trie(self.max_tree_depth)
            row = token_ids[s]
            kcap = min(k, int(max_drafts[r]))
            while True:
                c = propose_row(trie.nodes, trie.edges, trie.table, trie.meta, trie.active,
                                row, n, g.nodes, g.edges, g.table, self._pool, self._pool_len,
                                self.max_tree_depth, kcap, self.max_spec_factor,
                                self.min_token_prob, drafts[r])
                if c >= 0:
                    break
                trie.grow()  # the context's new tokens need room; resume where it stopped
            num_drafts[r] = c

    # ----------------------------------------------------------------- the global pool

    def _reserve_pool(self, extra: int) -> None:
        """Room for `extra` positions from _pool_len on (a compaction may move _pool_len)."""
        if self._pool_len + extra <= self._pool.shape[0]:
            return
        self._compact()
        need = self._pool_len + extra
        if need > self._pool.shape[0]:
            pool = np.full(max(2 * self._pool.shape[0], need), -1, np.int32)
            pool[: self._pool_len] = self._pool[: self._pool_len]
            self._pool = pool

    def _compact(self) -> None:
        """Drop the evicted prefix of the pool: live positions (and leaf edges) move down."""
        shift = self._pool_start
        if shift == 0:
            return
        live = self._pool_len - shift
        self._pool[:live] = self._pool[shift: self._pool_len]
        self._pool[live:] = -1
        shift_leaves(self._global.edges, self._global.meta[_M_EDGES], shift)
        self._cached = deque((a - shift, b - shift) for a, b in self._cached)
        self._pool_len = live
        self._pool_start = 0
