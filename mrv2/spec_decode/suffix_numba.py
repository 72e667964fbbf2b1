"""Suffix decoding's depth-bounded suffix tries on the CPU: the numba kernels of suffix.py.

A trie holds every substring of length <= depth of its sequence(s), one node per distinct
string, with counts. It lives in flat arrays (suffix.py's `_Trie` owns and grows them):

* nodes int32 [cap, _NODE_COLS], node 0 the root (columns below);
* edges int32 [cap, _EDGE_COLS]: (parent, token) -> child, kept in each parent's doubly
  linked child list and found through `table`;
* table int32 [2^k]: an open-addressing hash (linear probing, backward-shift deletion) of
  edge ids, -1 empty, at most half full;
* meta int64 [_META_LEN]: high-water marks, free lists, counters.

Singleton paths are not stored: a child string that occurs once is a *leaf edge* holding the
position q where that one occurrence ends; its descendants are implicit, the tokens seq[q+1:]
(up to the depth bound, the sequence's known length `limit`, and a -1 sentinel in the global
pool). A node is made ("materialised") when the string's second occurrence arrives. This keeps
memory near one edge per token plus one node per repeated substring instead of depth nodes
per token.

Counts: count(w) = occurrences of w; out(w) = those followed by a next token = the sum of its
children's counts (a leaf edge counts 1). Probabilities use out(w), not count(w): the
occurrence that ends the sequence (for a request's own trie, the current suffix itself) has no
continuation and must not dilute them.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Node columns.
_N_COUNT = 0  # occurrences of the node's string
_N_OUT = 1  # ... followed by a next token (sum of the children's counts)
_N_DEPTH = 2  # string length; -1 marks a free node
_N_BEST = 3  # edge of the most frequent child (ties: smaller token), -1 none (root: unused)
_N_BEST_CNT = 4  # that child's count
_N_FIRST = 5  # first edge of the child list; a free node: the next free node
_NODE_COLS = 6
# Edge columns.
_E_PARENT = 0  # -1 marks a free edge
_E_TOKEN = 1
_E_CHILD = 2  # >= 1: a node; < 0: a leaf edge, its one occurrence ends at -child - 1
_E_NEXT = 3  # next sibling; a free edge: the next free edge
_E_PREV = 4  # previous sibling, -1 for the first
_EDGE_COLS = 5
# meta slots.
_M_NODES = 0  # node ids ever used (high-water mark)
_M_EDGES = 1  # edge ids ever used
_M_FREE_NODE = 2  # head of the free-node list, -1 none
_M_FREE_EDGE = 3  # head of the free-edge list
_M_LIVE_EDGES = 4  # edges in `table`
_M_SEEN = 5  # a request's trie: context tokens inserted so far
_META_LEN = 8


@njit(inline="always", cache=True)
def _home(parent, token, mask):
    h = np.uint64(parent) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(token)
    h ^= h >> np.uint64(29)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(32)
    return np.int64(h & np.uint64(mask))


@njit(cache=True)
def _find_slot(table, edges, parent, token):
    """The slot holding edge (parent, token), or the empty slot where it would go."""
    mask = table.shape[0] - 1
    i = _home(parent, token, mask)
    while True:
        e = table[i]
        if e < 0 or (edges[e, _E_PARENT] == parent and edges[e, _E_TOKEN] == token):
            return i
        i = (i + 1) & mask


@njit(cache=True)
def _take(meta, free, count, links, link):
    """A row off the free list threaded through links[:, link] (head meta[free]), else the
    next new row (meta[count])."""
    i = meta[free]
    if i >= 0:
        meta[free] = links[i, link]
    else:
        i = meta[count]
        meta[count] += 1
    return i


@njit(cache=True)
def _new_edge(nodes, edges, table, meta, slot, parent, token, child):
    e = _take(meta, _M_FREE_EDGE, _M_EDGES, edges, _E_NEXT)
    head = nodes[parent, _N_FIRST]
    edges[e, _E_PARENT] = parent
    edges[e, _E_TOKEN] = token
    edges[e, _E_CHILD] = child
    edges[e, _E_NEXT] = head
    edges[e, _E_PREV] = -1
    if head >= 0:
        edges[head, _E_PREV] = e
    nodes[parent, _N_FIRST] = e
    table[slot] = e
    meta[_M_LIVE_EDGES] += 1
    return e


@njit(cache=True)
def _drop_edge(nodes, edges, table, meta, slot, e):
    """Remove edge e (found at `slot`) from the table and its parent's child list."""
    mask = table.shape[0] - 1
    i = slot
    table[i] = -1
    j = i
    while True:  # backward shift: no probe chain may pass through an empty slot
        j = (j + 1) & mask
        f = table[j]
        if f < 0:
            break
        k = _home(edges[f, _E_PARENT], edges[f, _E_TOKEN], mask)
        # f may fill the hole at i unless its home lies cyclically in (i, j]
        if (i <= j and (k <= i or k > j)) or (i > j and k <= i and k > j):
            table[i] = f
            table[j] = -1
            i = j
    nxt, prv = edges[e, _E_NEXT], edges[e, _E_PREV]
    if prv >= 0:
        edges[prv, _E_NEXT] = nxt
    else:
        nodes[edges[e, _E_PARENT], _N_FIRST] = nxt
    if nxt >= 0:
        edges[nxt, _E_PREV] = prv
    edges[e, _E_PARENT] = -1
    edges[e, _E_NEXT] = meta[_M_FREE_EDGE]
    meta[_M_FREE_EDGE] = e
    meta[_M_LIVE_EDGES] -= 1


@njit(cache=True)
def _new_node(nodes, meta, depth, count):
    v = _take(meta, _M_FREE_NODE, _M_NODES, nodes, _N_FIRST)
    nodes[v, _N_COUNT] = count
    nodes[v, _N_OUT] = 0
    nodes[v, _N_DEPTH] = depth
    nodes[v, _N_BEST] = -1
    nodes[v, _N_BEST_CNT] = 0
    nodes[v, _N_FIRST] = -1
    return v


@njit(inline="always", cache=True)
def _child_count(nodes, edges, e):
    c = edges[e, _E_CHILD]
    return 1 if c < 0 else nodes[c, _N_COUNT]


@njit(inline="always", cache=True)
def _raise_best(nodes, edges, v, e, cnt):
    """Child edge e of v now has count `cnt` (counts only grew): keep v's best child."""
    b = nodes[v, _N_BEST]
    bc = nodes[v, _N_BEST_CNT]
    if b == e or b < 0 or cnt > bc or (cnt == bc and edges[e, _E_TOKEN] < edges[b, _E_TOKEN]):
        nodes[v, _N_BEST] = e
        nodes[v, _N_BEST_CNT] = cnt


@njit(cache=True)
def _recompute_best(nodes, edges, v):
    """v's best child from its child list (after a count fell)."""
    best, best_cnt = -1, 0
    e = nodes[v, _N_FIRST]
    while e >= 0:
        c = _child_count(nodes, edges, e)
        if best < 0 or c > best_cnt or (c == best_cnt
                                        and edges[e, _E_TOKEN] < edges[best, _E_TOKEN]):
            best, best_cnt = e, c
        e = edges[e, _E_NEXT]
    nodes[v, _N_BEST] = best
    nodes[v, _N_BEST_CNT] = best_cnt


@njit(cache=True)
def extend(nodes, edges, table, meta, active, seq, p, end, depth):
    """Insert seq[p:end] one token at a time; returns the position reached: `end`, or less
    when the arrays ran short (the caller grows them and calls again from there).

    Invariant: before token p, active[k] (k < depth) is the node of the suffix of length k of
    seq[:p] when that string is a node, else -1 (it occurs once, or p < k); active[0] is the
    root. Appending t = seq[p] touches at most `depth` nodes: each explicit active[k] gains
    an occurrence of its child t.
    """
    while p < end:
        # per token at most one node and one edge per k
        if (meta[_M_NODES] + depth > nodes.shape[0] or meta[_M_EDGES] + depth > edges.shape[0]
                or 2 * (meta[_M_LIVE_EDGES] + depth) > table.shape[0]):
            return p
        t = seq[p]
        # k descending: active[k + 1] is written after it was read as the source of k + 1
        for k in range(depth - 1, -1, -1):
            w = active[k]
            if w < 0:  # w occurs once (this occurrence): so does w + t, implicitly
                active[k + 1] = -1
                continue
            nodes[w, _N_OUT] += 1
            slot = _find_slot(table, edges, w, t)
            e = table[slot]
            if e < 0:
                e = _new_edge(nodes, edges, table, meta, slot, w, t, -(p + 1))
                _raise_best(nodes, edges, w, e, 1)
                active[k + 1] = -1
                continue
            v = edges[e, _E_CHILD]
            if v >= 0:
                nodes[v, _N_COUNT] += 1
            else:  # second occurrence of w + t: materialise it
                q = -v - 1  # its first occurrence ends at q < p
                v = _new_node(nodes, meta, k + 1, 2)
                edges[e, _E_CHILD] = v
                # the first occurrence's continuation (ends at q + 1 <= p): a leaf edge of v;
                # active[k + 1] is -1 there, so it is not counted twice
                if k + 1 < depth and seq[q + 1] >= 0:
                    slot2 = _find_slot(table, edges, v, seq[q + 1])
                    e2 = _new_edge(nodes, edges, table, meta, slot2, v, seq[q + 1], -(q + 2))
                    nodes[v, _N_OUT] = 1
                    _raise_best(nodes, edges, v, e2, 1)
            _raise_best(nodes, edges, w, e, nodes[v, _N_COUNT])
            active[k + 1] = v
        p += 1
    return p


@njit(inline="always", cache=True)
def _free_if_dead(nodes, meta, w):
    if w != 0 and nodes[w, _N_COUNT] == 0:
        nodes[w, _N_DEPTH] = -1
        nodes[w, _N_FIRST] = meta[_M_FREE_NODE]
        meta[_M_FREE_NODE] = w


@njit(cache=True)
def remove_seq(nodes, edges, table, meta, pool, a, b, depth):
    """Remove the sequence pool[a:b] (inserted by `extend`) from the trie: every window of it
    gives its occurrences back; strings left with none lose their edge (and node). A node
    left with one occurrence stays a node (it is not folded back into a leaf edge): the rules
    above hold for it as well, and nodes stay bounded by the live sequences' substrings."""
    for i in range(a, b):
        w = 0
        left_on = True  # the window ends on node w (not beyond it, on a leaf edge)
        for j in range(i, min(b, i + depth)):
            nodes[w, _N_OUT] -= 1
            slot = _find_slot(table, edges, w, pool[j])
            e = table[slot]
            v = edges[e, _E_CHILD]
            # counts fall along the path: once a string is gone, so are its extensions
            gone = v < 0 or nodes[v, _N_COUNT] == 1
            was_best = nodes[w, _N_BEST] == e
            if gone:
                _drop_edge(nodes, edges, table, meta, slot, e)
            if v >= 0:
                nodes[v, _N_COUNT] -= 1
            if w != 0 and nodes[w, _N_COUNT] > 0 and was_best:  # else the best still leads
                _recompute_best(nodes, edges, w)
            _free_if_dead(nodes, meta, w)  # a dead w's last child edge went just now
            if v < 0:
                left_on = False
                break
            w = v
        if left_on:
            _free_if_dead(nodes, meta, w)  # the window ended on w (the depth or the sequence)


@njit(cache=True)
def rehash(table, edges, n_edges):
    """Insert the live edges (ids < n_edges) into the empty `table` (all -1)."""
    for e in range(n_edges):
        if edges[e, _E_PARENT] >= 0:
            table[_find_slot(table, edges, edges[e, _E_PARENT], edges[e, _E_TOKEN])] = e


@njit(cache=True)
def shift_leaves(edges, n_edges, shift):
    """The pool moved left by `shift`: every leaf edge's position follows."""
    for e in range(n_edges):
        if edges[e, _E_PARENT] >= 0 and edges[e, _E_CHILD] < 0:
            edges[e, _E_CHILD] += shift  # -(q + 1) -> -(q - shift + 1)


@njit(cache=True)
def _walk(nodes, edges, seq, limit, v, q, d, depth, cap, min_prob, out):
    """The greedy draft from a matched string of length d: node v, or (v < 0) the implicit
    string whose one occurrence ends at q. Follows the most frequent child while the path
    probability (product of count(child) / out(parent)) stays >= min_prob. Returns
    (tokens written to out, score = the sum of the tokens' path probabilities)."""
    n, prob, score = 0, 1.0, 0.0
    while n < cap and d < depth:
        if v >= 0:
            o = nodes[v, _N_OUT]
            if o == 0:
                break
            prob *= nodes[v, _N_BEST_CNT] / o
            if prob < min_prob:
                break
            e = nodes[v, _N_BEST]
            tok = edges[e, _E_TOKEN]
            c = edges[e, _E_CHILD]
            if c >= 0:
                v = c
            else:
                v, q = -1, -c - 1
        else:  # one occurrence: its next token, with probability 1 / 1
            q += 1
            if q >= limit or seq[q] < 0:
                break
            tok = seq[q]
        out[n] = tok
        n += 1
        score += prob
        d += 1
    return n, score


@njit(inline="always", cache=True)
def _cap(kcap, factor, m):
    # at least one token for a match; float slack as arctic-inference's int(m * f + 1e-6)
    return min(kcap, max(1, int(m * factor + 1e-6)))


@njit(cache=True)
def _match(nodes, edges, table, pool, limit, ctx, n, m):
    """Walk ctx[n - m:n] down the trie: (found, node or -1, leaf position)."""
    v, q = 0, -1
    for j in range(n - m, n):
        t = ctx[j]
        if v >= 0:
            e = table[_find_slot(table, edges, v, t)]
            if e < 0:
                return False, -1, -1
            c = edges[e, _E_CHILD]
            if c >= 0:
                v = c
            else:
                v, q = -1, -c - 1
        else:
            q += 1
            if q >= limit or pool[q] != t:
                return False, -1, -1
    return True, v, q


@njit(cache=True)
def propose_row(o_nodes, o_edges, o_table, o_meta, active, ctx, n, g_nodes, g_edges, g_table,
                pool, pool_len, depth, kcap, factor, min_prob, out):
    """One row: extend the request's trie with ctx[seen:n], then write the best draft into
    out (the rest of it 0) and return its length; -1 when the request's trie needs room
    first. For each match length m = 1 .. min(depth - 1, n) of each trie the greedy draft is
    scored; a trie keeps its best (ties: the longer match), the request's own wins ties."""
    p = extend(o_nodes, o_edges, o_table, o_meta, active, ctx, o_meta[_M_SEEN], n, depth)
    o_meta[_M_SEEN] = p
    if p < n:
        return -1
    out[:] = 0
    if kcap <= 0:
        return 0
    buf = np.empty(kcap, np.int32)
    best_n, best_score = 0, 0.0
    for m in range(1, min(depth - 1, n) + 1):
        # the own trie holds the context: its suffix is a node iff it also occurs earlier
        v = active[m]
        if v < 0:
            break
        c, score = _walk(o_nodes, o_edges, ctx, n, v, -1, m, depth, _cap(kcap, factor, m),
                         min_prob, buf)
        if c > 0 and score >= best_score:
            out[:c] = buf[:c]
            out[c:] = 0
            best_n, best_score = c, score
    if pool_len == 0:
        return best_n
    g_n, g_score = 0, 0.0
    gbuf = np.empty(kcap, np.int32)
    for m in range(1, min(depth - 1, n) + 1):
        found, v, q = _match(g_nodes, g_edges, g_table, pool, pool_len, ctx, n, m)
        if not found:  # no longer suffix can occur either
            break
        c, score = _walk(g_nodes, g_edges, pool, pool_len, v, q, m, depth,
                         _cap(kcap, factor, m), min_prob, buf)
        if c > 0 and score >= g_score:
            gbuf[:c] = buf[:c]
            g_n, g_score = c, score
    if g_n > 0 and g_score > best_score:
        out[:] = 0
        out[:g_n] = gbuf[:g_n]
        best_n = g_n
    return best_n
