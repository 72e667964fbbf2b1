"""Startup objects out of the cyclic garbage collector's way, in the engine's own processes.

Importing torch, transformers and the model leaves hundreds of thousands of long-lived Python
objects; every full (generation 2) collection walks all of them. In a fresh `mrv2 serve` these
collections paused the server and the engine core for 13-250 ms each (seen as a 260 ms p99
TTFT in bench/test_server_latency.py). `gc.freeze()` moves every object alive now into a
permanent generation that collections skip; objects created later are collected as usual
(vLLM freezes the same way).

Only for processes that hold one engine for their whole life (the engine-core process, the
API server, worker processes): a frozen object that later becomes cyclic garbage is never
reclaimed, so a process that builds and drops several engines (tests, notebooks with
`LLM(...)`) must not freeze.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect what is garbage now (so it is freed, not frozen), then freeze the rest."""
    gc.collect()
    gc.freeze()
