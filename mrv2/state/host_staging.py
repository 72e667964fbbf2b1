"""Double-buffered host staging for host-to-device uploads (DESIGN.md invariant 5).

Each upload packs its bytes into one host buffer and copies them to the device with one
non_blocking copy. Two host buffers alternate: while the copy from one may still be in flight,
the host fills the other. On CUDA the buffers are pinned, each has an event re-recorded after every
copy from it, and a buffer is refilled only after that event has completed (which, two uploads
later, it practically always has: the wait costs nothing in the steady state). The events are
blocking ones: a wait sleeps instead of spinning on a core the host's step work needs.
"""

from __future__ import annotations

import numpy as np
import torch

_MIN_BYTES = 4096


def _grow(size: int) -> int:
    return max(_MIN_BYTES, 1 << (size - 1).bit_length())


class HostStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._pinned_np: list[np.ndarray | None] = [None, None]
        # Per buffer: its event, and whether a copy from it was recorded since the last wait.
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._in_flight = [False, False]
        self._current = 0
        self._device_buf: torch.Tensor | None = None

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """The buffer to fill next, as uint8 numpy (at least `nbytes`): no copy reads it."""
        i = self._current
        if self._in_flight[i]:
            self._events[i].synchronize()
            self._in_flight[i] = False
        host = self._pinned[i]
        if host is None or host.numel() < nbytes:
            # A buffer an in-flight copy still reads stays alive: the pinned allocator defers
            # its reuse until that copy's stream has passed it.
            host = torch.empty(_grow(nbytes), dtype=torch.uint8, pin_memory=self._cuda)
            self._pinned[i] = host
            self._pinned_np[i] = host.numpy()
        return self._pinned_np[i]

    def upload(self, nbytes: int) -> torch.Tensor:
        """Copy the first `nbytes` of the buffer just filled to the device; returns the device
        bytes (valid in stream order until the next upload) and flips to the other buffer."""
        i = self._current
        dev = self._device_buf
        if dev is None or dev.numel() < nbytes:
            # The old device buffer may still be read by a queued kernel: the caching
            # allocator only reuses it in stream order.
            dev = self._device_buf = torch.empty(_grow(nbytes), dtype=torch.uint8,
                                                 device=self.device)
        out = dev[:nbytes]
        out.copy_(self._pinned[i][:nbytes], non_blocking=True)
        if self._cuda:
            if self._events[i] is None:
                self._events[i] = torch.cuda.Event(blocking=True)
            self._events[i].record(torch.cuda.current_stream(self.device))
            self._in_flight[i] = True
        self._current = 1 - i
        return out


def upload_array(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device` without a host sync: on CUDA through pinned memory and a
    non_blocking copy (the pinned allocator keeps the buffer until the copy has run; a
    pageable source would make the copy synchronous); on the CPU the array itself."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
