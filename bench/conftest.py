import sys
from pathlib import Path

# Benchmark workloads live next to the cases and are imported by module name.
sys.path.insert(0, str(Path(__file__).parent))
