import sys
from pathlib import Path

# The helpers (input_batch_helpers.py) live next to the tests and are imported by name.
sys.path.insert(0, str(Path(__file__).parent))
