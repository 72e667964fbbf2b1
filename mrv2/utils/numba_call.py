"""TypedCall: a numba kernel called with many long-lived arguments, typed once each.

numba's dispatcher types every argument at every call before it picks the compiled overload;
for an ndarray that is quick, but a tuple is typed element by element in Python. The fused
decode stack takes dozens of per-model tuples and typed lists that stay the same objects from
step to step, and typing them took about a millisecond a call (bench/README.md). TypedCall
keeps the type of each argument object it last saw (by identity: an object's numba type
cannot change) and calls the overload for the types directly; new objects (a step's own
arrays) are typed as numba would, so the overload is always the one numba would pick.
"""

from __future__ import annotations

from typing import Any

from numba.core.dispatcher import Dispatcher


class TypedCall:
    def __init__(self, kernel: Dispatcher) -> None:
        self.kernel = kernel
        self._args: tuple = ()
        self._types: tuple = ()

    def __call__(self, *args: Any) -> Any:
        kernel, last = self.kernel, self._args
        if len(last) == len(args):
            types = tuple(t if a is b else kernel.typeof_pyval(a)
                          for a, b, t in zip(args, last, self._types))
        else:
            types = tuple(map(kernel.typeof_pyval, args))
        # Kept to compare identities with the next call's (and so alive until then).
        self._args, self._types = args, types
        compiled = kernel.overloads.get(types)
        if compiled is None:  # not compiled for these types yet: numba compiles it
            return kernel(*args)
        return compiled.entry_point(*args)
