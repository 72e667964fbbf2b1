"""Host memory on transparent huge pages: the CPU KV cache (worker.py allocates it here) and
the weights a decode step streams (`collapse`: the worker's loaded weights, oneDNN's packed
copies where they are made).

Why: a decode step reads each row's KV blocks where its block table puts them, scattered over
the whole cache. On 4 KiB pages nearly every block costs a TLB miss and a page walk through page
tables that are themselves out of the cache; one 2 MiB page covers a run of blocks (bench/
README.md has the measurement). Linux backs memory with huge pages where the memory asks for
them (madvise) and transparent huge pages are "madvise" or "always"; elsewhere, or where the
kernel refuses, the same call gives ordinary pages.

The memory is a fresh anonymous mapping, written with zeros at once as torch.zeros' is: every
page is resident (as huge pages) from the start, so a machine without the memory fails when
the cache is allocated rather than in the middle of a request. It is unmapped when the last
tensor viewing it goes.

Weights already in memory (allocated by torch, glibc or oneDNN, on ordinary pages) are moved
onto huge pages in place by `collapse` (MADV_COLLAPSE, Linux 6.1): every 2 MiB page of the
address space that holds any of a tensor's bytes, so a huge page may hold other memory too
(the kernel copies it along; nothing changes for it, and the page's untouched 4 KiB pages
become resident). A decode step reads every weight once: on 4 KiB pages its stream takes a
TLB miss per page, and under a hypervisor each walk is two-dimensional.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from collections.abc import Iterable
from functools import lru_cache

import torch

HUGE_PAGE_BYTES = 2 << 20
# "0" leaves the weights on the pages they were allocated on (`collapse_weights`): collapsing
# copies every weight once (about a second a gigabyte here), which start-up-bound runs such as
# the test suite skip.
WEIGHTS_ENV = "MRV2_HUGE_PAGE_WEIGHTS"
_MADV_COLLAPSE = 25  # linux/mman.h; Python's mmap module names it from 3.14 only


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory starts on a huge-page boundary and is advised onto huge
    pages (MADV_HUGEPAGE); under a huge page's size, or where the platform has no such advice,
    torch.zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # One huge page more than needed, so that a huge-page-aligned run of nbytes lies inside.
    # Private: a shared anonymous mapping is shmem, whose huge pages another setting governs
    # (shmem_enabled, usually "never").
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # its storage keeps the mapping
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # transparent huge pages off or unsupported: ordinary pages
        pass
    # A tensor on the mapping's storage, not a view of `whole`: a view keeps its base alive,
    # so the worker's `set_` (sleep) would not free the memory.
    tensor = torch.empty(0, dtype=dtype).set_(whole.untyped_storage(), start // dtype.itemsize,
                                               shape)
    return tensor.zero_()  # fault every page in now, after the advice


@lru_cache(maxsize=1)
def _madvise():
    """libc's madvise(address, length, advice), or None off Linux or without it."""
    if sys.platform != "linux":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def memory_of(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory holding a CPU tensor: its storage, or the buffer of a
    tensor in oneDNN's opaque layout (a packed weight)."""
    if tensor.layout == torch._mkldnn:
        return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Move the memory of `tensors` (CPU tensors, `memory_of` each) onto huge pages now, in
    place, contents unchanged: every 2 MiB page holding any of their bytes, each once, so
    small tensors side by side share their pages. Returns how many pages the kernel collapsed.
    Best effort: off the CPU, on a kernel without MADV_COLLAPSE, or where the kernel refuses a
    page (one spanning two kinds of mapping, no free huge page), pages stay as they are."""
    madvise = _madvise()
    if madvise is None:
        return 0
    pages: set[int] = set()
    for tensor in tensors:
        if tensor.device.type == "cpu":
            address, nbytes = memory_of(tensor)
            pages.update(range(address // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, address + nbytes,
                               HUGE_PAGE_BYTES))
    # One page at a time: a refused page leaves the others to be collapsed.
    return sum(madvise(page, HUGE_PAGE_BYTES, _MADV_COLLAPSE) == 0 for page in sorted(pages))


def collapse_weights(tensors: Iterable[torch.Tensor]) -> int:
    """`collapse` for the weights a decode step streams (the worker's loaded weights, oneDNN's
    packings), unless MRV2_HUGE_PAGE_WEIGHTS is "0"."""
    if os.environ.get(WEIGHTS_ENV, "1") == "0":
        return 0
    return collapse(tensors)


def mapping_fields(tensor: torch.Tensor, smaps: str = "/proc/self/smaps") -> dict[str, str]:
    """The /proc smaps fields ("VmFlags", "AnonHugePages", ...) of the mapping holding
    `tensor`'s first byte, each with the rest of its line; empty where /proc says nothing."""
    address, fields, inside = tensor.data_ptr(), {}, False
    try:
        with open(smaps) as f:
            for line in f:
                head, _, rest = line.partition(" ")
                if "-" in head and not head.endswith(":"):  # a mapping's address range
                    if fields:
                        break
                    low, high = (int(part, 16) for part in head.split("-"))
                    inside = low <= address < high
                elif inside:
                    fields[head.rstrip(":")] = rest.strip()
    except OSError:
        return {}
    return fields


def advised_huge(tensor: torch.Tensor, smaps: str = "/proc/self/smaps") -> bool:
    """Whether the mapping holding `tensor`'s first byte is advised onto huge pages (its
    VmFlags list "hg"); False where /proc says nothing."""
    return "hg" in mapping_fields(tensor, smaps).get("VmFlags", "").split()
