import sys
from pathlib import Path

# The helpers (block_table_helpers.py, staged_helpers.py) live next to the tests and are
# imported by name.
sys.path.insert(0, str(Path(__file__).parent))
