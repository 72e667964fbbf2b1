import os
import sys
from pathlib import Path

# Benchmark workloads live next to the cases and are imported by module name.
sys.path.insert(0, str(Path(__file__).parent))

import pytest
import torch

# dtype="auto" on the CPU follows the machine; the cases name a dtype where it is what they
# measure, and "auto" stays float32, as in the figures recorded in bench/README.md.
os.environ.setdefault("MRV2_CPU_AUTO_DTYPE", "float32")


@pytest.fixture(scope="module")
def two_threads():
    """torch on both cores of these machines for the module's cases (the measured setting)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)
