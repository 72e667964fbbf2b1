"""Deferred: a worker method's result that is not ready when the method returns.

Phase 2 of a step ends with a device-to-host copy of the sampled tokens. Waiting for it inside
the worker's call would keep the worker from receiving and starting step N+1's phase 1, so the
worker returns a `Deferred` instead, and the executor resolves it on a reply thread: the
worker's main loop goes on at once, and the caller still receives the resolved value (its
future completes when the copy has). Replies keep the order of the calls.

A method that may return one is annotated `-> T | Deferred[T]`: the RPC decoder reads `T`.
"""

from __future__ import annotations

import queue
import threading
import traceback
import types
import typing
from collections.abc import Callable
from typing import Any, Generic, TypeVar

Value = TypeVar("Value")

# send(result, error): deliver one reply; exactly one of the two is meaningful.
Send = Callable[[Any, "BaseException | None"], None]


class Deferred(Generic[Value]):
    def resolve(self) -> Value:
        """Wait for the value (on the executor's reply thread, not the worker's main loop)."""
        raise NotImplementedError


class _Marker(Deferred[None]):
    def resolve(self) -> None:
        return None


def resolved_type(hint: Any) -> Any:
    """The type a caller receives from a method annotated `hint`: `Deferred[T]` -> T, and
    `T | Deferred[T]` -> T."""
    if typing.get_origin(hint) is Deferred:
        return typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        kept = tuple(a for a in args if a is not Deferred and typing.get_origin(a) is not Deferred)
        if len(kept) != len(args):
            return kept[0] if len(kept) == 1 else typing.Union[kept]
    return hint


class OrderedReplies:
    """Delivers replies in submission order, resolving a `Deferred` value first.

    The submitting thread sends directly while nothing is queued (no thread hop for a reply
    that is ready); once a deferred value is queued, later replies queue behind it, so the
    receiver sees them in call order. One daemon thread, started on first use.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._outstanding = 0  # queued, not yet delivered; written under _lock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, value: Any, send: Send) -> None:
        with self._lock:
            direct = self._outstanding == 0 and not isinstance(value, Deferred)
            if not direct:
                self._outstanding += 1
        if direct:
            send(value, None)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((value, send))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued reply has been delivered; False on timeout."""
        done = threading.Event()
        with self._lock:
            if self._outstanding == 0:
                return True
        self.submit(_Marker(), lambda *_: done.set())
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            value, send = self._queue.get()
            try:
                error = None
                if isinstance(value, Deferred):
                    try:
                        value = value.resolve()
                    except BaseException as e:  # the caller receives it, in order
                        value, error = None, e
                send(value, error)
            except BaseException:  # a reply that cannot be delivered (the receiver is gone)
                traceback.print_exc()
            finally:
                with self._lock:
                    self._outstanding -= 1
