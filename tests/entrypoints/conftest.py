import sys
from pathlib import Path

# The executor helpers of tests/executor (executor_helpers.py) are imported by name.
sys.path.insert(0, str(Path(__file__).parent.parent / "executor"))
