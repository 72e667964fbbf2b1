"""Test and demo fixtures: seeded random-weight HF models, a locally trained tokenizer, and a
real `mrv2 serve` process (ServerProcess).

Nothing here downloads anything. Names are resolved lazily so that importing the tokenizer
helpers does not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2.testing.server import ServerProcess, free_port
    from mrv2.testing.tiny_model import SUPPORTED_ARCHS, default_demo_model_path, make_tiny_model
    from mrv2.testing.tokenizer import get_tokenizer_dir
    from mrv2.utils.disk_cache import cache_root

__all__ = ["SUPPORTED_ARCHS", "ServerProcess", "cache_root", "default_demo_model_path",
           "free_port", "get_tokenizer_dir", "make_tiny_model"]

_WHERE = {
    "SUPPORTED_ARCHS": "mrv2.testing.tiny_model",
    "default_demo_model_path": "mrv2.testing.tiny_model",
    "make_tiny_model": "mrv2.testing.tiny_model",
    "ServerProcess": "mrv2.testing.server",
    "free_port": "mrv2.testing.server",
    "cache_root": "mrv2.utils.disk_cache",
    "get_tokenizer_dir": "mrv2.testing.tokenizer",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mrv2.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
