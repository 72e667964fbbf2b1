import sys
from pathlib import Path

# The shared harness (sampler_harness.py) lives next to the tests and is imported by name.
sys.path.insert(0, str(Path(__file__).parent))
