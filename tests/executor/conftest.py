import sys
from pathlib import Path

# The helpers (executor_helpers.py) live next to the tests and are imported by name; spawned
# workers get the parent's sys.path, so they can unpickle a helper sent as an RPC.
sys.path.insert(0, str(Path(__file__).parent))
