import sys
from pathlib import Path

# Benchmark workloads live next to the cases and are imported by module name.
sys.path.insert(0, str(Path(__file__).parent))

import pytest
import torch


@pytest.fixture(scope="module")
def two_threads():
    """torch on both cores of these machines for the module's cases (the measured setting)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)
