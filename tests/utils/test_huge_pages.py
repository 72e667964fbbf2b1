"""huge_pages.zeros: zeroed, writable, the shape and dtype asked for, starting on a huge page
and advised onto huge pages where the kernel takes the advice; small tensors are plain."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from mrv2.utils import huge_pages
from mrv2.utils.huge_pages import HUGE_PAGE_BYTES


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_of_the_shape_asked_for(dtype):
    shape = (2, 33, 16, 3, 64)  # a KV cache layer of 33 blocks
    t = huge_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[1, 32, 15, 2, 63] = 3.0
    t[0, 0, 0, 0, 0] = -1.0
    assert t.sum().item() == 2.0
    if t.numel() * t.element_size() >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % HUGE_PAGE_BYTES == 0


def _huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of every mapping holding any of the tensor's bytes, in KiB (/proc). Every
    one, not the first byte's alone: a tensor on the heap may span several mappings where
    numpy advised huge pages on part of the heap (madvise splits a mapping by its flags)."""
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low < last and first < high
            elif inside and head == "AnonHugePages:":
                total += int(rest.split()[0])
    return total


def test_large_tensors_are_advised_onto_huge_pages_and_get_them():
    t = huge_pages.zeros((3, HUGE_PAGE_BYTES // 4), torch.float32)
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    # A mapping nobody advised reads as not advised. (A small torch tensor would sit on the heap,
    # whose advice follows the process's allocation history: numpy advises its large buffers.)
    plain = mmap.mmap(-1, 2 * HUGE_PAGE_BYTES)
    assert not huge_pages.advised_huge(torch.frombuffer(plain, dtype=torch.uint8))
    if _thp_mode() not in ("madvise", "always") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    assert huge_pages.advised_huge(t)
    t.fill_(1.0)  # pages are made resident (as huge pages) where first written
    # A private mapping: a shared anonymous one (shmem) got none under "madvise".
    assert _huge_kib(t) >= HUGE_PAGE_BYTES // 1024


def test_small_tensors_are_plain_zeros(monkeypatch):
    # No mapping of its own, so no advice. (Asking /proc whether the heap region under a small
    # tensor is advised depended on the process's allocation history: numpy advises huge pages
    # on its large buffers, and glibc may serve those from the heap, reused later for small
    # ones.)
    def no_mapping(*args, **kwargs):
        raise AssertionError("a tensor under a huge page got a mapping of its own")

    monkeypatch.setattr(huge_pages.mmap, "mmap", no_mapping)
    t = huge_pages.zeros((4, 1024), torch.float32)
    assert not t.any() and t.shape == (4, 1024)


def test_the_memory_lives_as_long_as_a_view_of_it():
    t = huge_pages.zeros((HUGE_PAGE_BYTES // 2,), torch.float32)
    part = t[10:20]
    del t
    gc.collect()
    part.fill_(7.0)
    assert part.sum().item() == 70.0


def test_advised_huge_without_proc_says_no(tmp_path):
    t = huge_pages.zeros((HUGE_PAGE_BYTES,), torch.uint8)
    assert not huge_pages.advised_huge(t, smaps=str(tmp_path / "missing"))


def test_setting_an_empty_storage_frees_the_memory():
    """Worker.sleep empties the cache tensors in place (`set_`): the tensor must be no view of
    another that would keep the mapping, and every page goes back to the system."""
    from tests.entrypoints.test_llm_sleep import resident_gb

    t = huge_pages.zeros((2, HUGE_PAGE_BYTES), torch.uint8)
    assert t._base is None
    ranges = [(t.data_ptr(), t.numel())]
    assert resident_gb(ranges) * (1 << 30) == t.numel()  # zeroed at once: all resident
    t.set_(t.new_empty(0))
    gc.collect()
    assert resident_gb(ranges) == 0


def _kernel_collapses() -> bool:
    """Linux 6.1 or later (MADV_COLLAPSE) with transparent huge pages on."""
    import platform

    try:
        major, minor = (int(part) for part in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (platform.system() == "Linux" and (major, minor) >= (6, 1)
            and _thp_mode() in ("madvise", "always"))


def test_collapse_moves_a_tensor_onto_huge_pages_in_place():
    t = torch.randn(3 * HUGE_PAGE_BYTES // 4 + 1000)  # torch's own allocation, 4 KiB pages
    before, address = t.clone(), t.data_ptr()
    pages = huge_pages.collapse([t])
    assert t.data_ptr() == address and torch.equal(t, before)
    if not _kernel_collapses():
        return
    # At least the 2 MiB pages wholly inside its ~6 MiB; the two it shares with the memory
    # around it where that memory is an anonymous mapping too.
    assert 2 <= pages <= 4
    assert _huge_kib(t) >= 2 * HUGE_PAGE_BYTES // 1024


def test_collapse_takes_a_packed_weight_and_leaves_its_products_unchanged():
    from mrv2.models.layers import cpu_linear

    if not cpu_linear.available():
        pytest.skip("torch without oneDNN")
    weight = torch.randn(1024, 1536)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    address, nbytes = huge_pages.memory_of(packed)
    assert address == torch.ops.mkldnn.data_ptr(packed) and nbytes >= weight.nbytes
    x = torch.randn(5, 1536)
    before = cpu_linear.onednn_linear(x, packed)
    pages = huge_pages.collapse([packed])
    assert torch.equal(cpu_linear.onednn_linear(x, packed), before)
    if _kernel_collapses():
        assert pages >= nbytes // HUGE_PAGE_BYTES - 1


def test_collapse_counts_each_page_once_and_a_view_by_its_whole_storage():
    whole = torch.zeros(HUGE_PAGE_BYTES)  # 8 MiB of float32
    part = whole[:10]
    assert huge_pages.memory_of(part) == (whole.data_ptr(), whole.nbytes)
    spanned = (whole.data_ptr() + whole.nbytes - 1) // HUGE_PAGE_BYTES \
        - whole.data_ptr() // HUGE_PAGE_BYTES + 1
    pages = huge_pages.collapse([part, whole, whole[5:]])
    assert pages <= spanned
    if _kernel_collapses():
        assert pages >= 3  # the pages wholly inside its 8 MiB, not just those of the view
    assert not whole.any()
    small = [torch.ones(100), torch.ones(100)]
    assert huge_pages.collapse(small) <= 2
    assert all(t.sum().item() == 100 for t in small)
    assert huge_pages.collapse([]) == 0


def test_collapse_weights_follows_the_switch(monkeypatch):
    t = torch.randn(HUGE_PAGE_BYTES // 4 * 3)
    monkeypatch.setenv(huge_pages.WEIGHTS_ENV, "0")
    assert huge_pages.collapse_weights([t]) == 0
    monkeypatch.setenv(huge_pages.WEIGHTS_ENV, "1")
    pages = huge_pages.collapse_weights([t])
    assert pages >= 2 if _kernel_collapses() else pages == 0
