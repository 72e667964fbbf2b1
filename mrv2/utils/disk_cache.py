"""mrv2's on-disk caches: their root, and numba's cache keyed to mrv2's source.

Why the key: numba invalidates a cached function when its own file changes, but a cached
function holds the compiled code of every jitted function it calls. After an edit of a kernel's
file (or a `git pull` on an editable install) a caller in another file, such as the fused
decode stack calling the GEMV, kept running the old kernel, silently. So each process points
numba at a directory named by a hash of mrv2's Python sources: any change to them starts a
fresh cache.
A NUMBA_CACHE_DIR the user set stands.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# Source digests whose numba caches stay on disk: the running one and the most recently used
# others, so that switching between versions (or timing two checkouts against each other)
# compiles each once, not at every start; older ones are removed.
KEPT_NUMBA_CACHES = 3


def cache_root() -> Path:
    """Root of mrv2's on-disk cache: ``$MRV2_CACHE_DIR`` or ``~/.cache/mrv2``."""
    env = os.environ.get("MRV2_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mrv2"


def source_digest(root: Path = PACKAGE_ROOT) -> str:
    """A hash of every .py file under `root`: relative paths and contents (~1 MB, a few ms)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def key_numba_cache_to_sources() -> str | None:
    """Set NUMBA_CACHE_DIR (environment, inherited by workers, and numba's config) to
    `cache_root()/numba/<source digest>` unless it is set; returns the directory in use, marked
    as just used (its mtime). Of the other digests' directories the KEPT_NUMBA_CACHES - 1 most
    recently used stay; the rest are removed (best effort: another version may be running).
    Where the directory cannot be made (a read-only home) numba keeps its default (None)."""
    current = os.environ.get("NUMBA_CACHE_DIR")
    if current:
        return current
    parent = cache_root() / "numba"
    directory = parent / source_digest()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.utime(directory)
    except OSError:
        return None
    others = sorted((d for d in parent.iterdir() if d != directory), key=_last_used,
                    reverse=True)
    for old in others[KEPT_NUMBA_CACHES - 1:]:
        shutil.rmtree(old, ignore_errors=True)
    os.environ["NUMBA_CACHE_DIR"] = str(directory)
    from numba.core import config  # after the environment: a config reload reads it too
    config.CACHE_DIR = str(directory)
    return str(directory)


def _last_used(directory: Path) -> float:
    try:
        return directory.stat().st_mtime
    except OSError:  # removed meanwhile by another process
        return 0.0
