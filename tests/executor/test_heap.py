"""freeze_startup_objects: objects alive at the call are frozen (skipped by collections),
garbage made before it is freed, and cycles made after it are still collected."""

from __future__ import annotations

import gc
import weakref

from executor.heap import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_freezes_live_objects_and_still_collects_later_cycles():
    before_garbage = _cycle()  # unreachable already: freed by the collect, not frozen
    try:
        freeze_startup_objects()
        assert before_garbage() is None
        assert gc.get_freeze_count() > 0
        after = _cycle()
        gc.collect()
        assert after() is None
    finally:
        gc.unfreeze()  # this test process builds many engines: do not keep them frozen
