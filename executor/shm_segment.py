"""Shared-memory segments for executor/shm_queue.py: attach without tracking, unlink by name,
and a memory fence.

Python < 3.13 registers every `SharedMemory` it opens with the process's resource tracker,
which unlinks it when that process exits, even when another process owns it. Readers attach
with `attach_segment` (untracked); the owner's registration stays in place, so a crashed owner's
segment is still cleaned up by its tracker.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

_FENCE_LOCK = threading.Lock()


def fence() -> None:
    """Full memory barrier: a lock round trip is an atomic read-modify-write in CPython."""
    with _FENCE_LOCK:
        pass


# The same barrier as two C calls, `fence_acquire(); fence_release()`, for per-message paths
# where a Python-level call is a measurable share of the cost (about half of `fence()`).
fence_acquire, fence_release = _FENCE_LOCK.acquire, _FENCE_LOCK.release


_ATTACH_LOCK = threading.Lock()


def attach_segment(name: str) -> SharedMemory:
    """Open an existing segment without registering it with this process's resource tracker
    (which would unlink it when this process exits, under the owner's feet)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    with _ATTACH_LOCK:
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def unlink_segment(name: str) -> bool:
    """Unlink a queue's segment by name (e.g. one whose writer died); False if already gone."""
    try:
        shm = attach_segment(name)
    except FileNotFoundError:
        return False
    shm.close()
    try:
        shm.unlink()  # also drops the owner's registration in the shared resource tracker
    except FileNotFoundError:
        return False
    return True
