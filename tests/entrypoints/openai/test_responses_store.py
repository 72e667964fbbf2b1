"""The bounded in-memory store of responses: least recently used out first, by count and by
size."""

from __future__ import annotations

import json

from mrv2.entrypoints.openai.responses_store import ResponseStore


def response(i: int, text: str = "") -> dict:
    return {"id": f"resp_{i}", "output": text}


def test_keeps_at_most_max_responses_least_recently_used_out():
    store = ResponseStore(max_responses=2)
    for i in range(2):
        assert store.put(response(i), [{"role": "user", "content": str(i)}])
    assert store.get("resp_0").conversation == [{"role": "user", "content": "0"}]  # now recent
    store.put(response(2), [])
    assert store.get("resp_1") is None and len(store) == 2
    assert store.get("resp_0").response == response(0) and store.get("resp_2") is not None


def test_keeps_at_most_max_bytes():
    one = len(json.dumps(response(0, "x" * 100))) + len(json.dumps([]))
    store = ResponseStore(max_bytes=2 * one + 1)
    for i in range(3):
        store.put(response(i, "x" * 100), [])
    assert [store.get(f"resp_{i}") is None for i in range(3)] == [True, False, False]
    assert store.num_bytes == 2 * one
    assert not store.put(response(9, "x" * 1000), [])  # alone over the bound: not kept
    assert store.get("resp_9") is None and len(store) == 2
    store.put(response(1, "y" * 100), [])  # the same id again: replaced, counted once
    assert store.num_bytes == 2 * one and store.get("resp_1").response["output"][0] == "y"


def test_keeps_a_copy():
    store, answer = ResponseStore(), response(0, "a")
    store.put(answer, [])
    answer["output"] = "changed"
    assert store.get("resp_0").response == response(0, "a")
