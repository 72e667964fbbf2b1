import sys
from pathlib import Path

# The shared harness (sampler_harness.py) lives next to the tests and is imported by name, as
# are the staged-tensor helpers of tests/state (staged_helpers.py).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent / "state"))
