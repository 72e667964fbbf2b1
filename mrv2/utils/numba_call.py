"""TypedCall: a numba kernel called with many long-lived arguments, typed once each.

numba's dispatcher types every argument at every call before it picks the compiled overload;
for an ndarray that is quick, but a tuple is typed element by element in Python. The fused
decode stack takes dozens of per-model tuples and typed lists that stay the same objects from
step to step, and typing them took about a millisecond a call (bench/README.md). TypedCall
keeps the type of each argument object it last saw (by identity: an object's numba type
cannot change) and calls the overload for the types directly; new objects (a step's own
arrays) are typed as numba would, so the overload is always the one numba would pick.

Two more per-call costs go the same way: a step's new ndarrays are typed from the few fields
numba's typeof reads (dtype, dimensions, layout, writeability: `_array_type`), and where every
type is the very object of the last call (numba interns its types) the last overload is called
without hashing the tuple of types again (dozens of nested types, each hashed recursively).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
from numba.core.dispatcher import Dispatcher


class TypedCall:
    def __init__(self, kernel: Dispatcher) -> None:
        self.kernel = kernel
        self._args: tuple = ()
        self._types: tuple = ()
        self._compiled: Any = None  # the overload of `_types`
        self._array_types: dict[tuple, Any] = {}

    def _array_type(self, value: np.ndarray) -> Any:
        """numba's type of an ndarray (exactly np.ndarray) from what its typeof reads."""
        flags = value.flags
        key = (value.dtype, value.ndim, flags.c_contiguous, flags.f_contiguous,
               flags.writeable)
        found = self._array_types.get(key)
        if found is None:
            found = self._array_types[key] = self.kernel.typeof_pyval(value)
        return found

    def _typeof(self, value: Any) -> Any:
        if type(value) is np.ndarray:
            return self._array_type(value)
        return self.kernel.typeof_pyval(value)

    def __call__(self, *args: Any) -> Any:
        kernel, last, last_types = self.kernel, self._args, self._types
        if len(last) == len(args):
            types = tuple(t if a is b else self._typeof(a)
                          for a, b, t in zip(args, last, last_types))
            same = self._compiled is not None and all(map(operator.is_, types, last_types))
        else:
            types, same = tuple(map(self._typeof, args)), False
        # Kept to compare identities with the next call's (and so alive until then).
        self._args, self._types = args, types
        compiled = self._compiled if same else kernel.overloads.get(types)
        if compiled is None:  # not compiled for these types yet: numba compiles it
            self._compiled = None
            return kernel(*args)
        self._compiled = compiled
        return compiled.entry_point(*args)
