"""Tests marked `cuda` in this folder skip when no CUDA GPU is visible."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The helpers (cudagraph_helpers.py) live next to the tests and are imported by name.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A per-directory hook: it only sees the tests under tests/cudagraph/.
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
