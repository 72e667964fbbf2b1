"""A Hugging Face Hub cache written by hand, as huggingface_hub lays it out, so that Hub ids
resolve offline in tests (nothing here touches the network)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT_MAIN = "a" * 40


def cache_repo(cache: Path, repo_id: str, files: dict[str, bytes], *, commit: str = COMMIT_MAIN,
               refs: tuple[str, ...] = ("main",), symlinks: bool = True) -> Path:
    """Write one snapshot of `repo_id` the way huggingface_hub lays out its cache, and return
    the snapshot directory: refs/<ref> holds the commit hash (no newline: huggingface_hub reads
    it verbatim), snapshots/<commit>/<file> is a relative symlink to blobs/<sha256>, or a plain
    file where symlinks are unavailable (huggingface_hub's Windows fallback, also accepted)."""
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    for name, data in files.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if symlinks:
            blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            os.symlink(os.path.relpath(blob, target.parent), target)
        else:
            target.write_bytes(data)
    snapshot.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


def cache_model_dir(cache: Path, repo_id: str, model_dir: Path, **kwargs) -> Path:
    """Every file of a local model directory as one snapshot of `repo_id`."""
    files = {str(p.relative_to(model_dir)): p.read_bytes()
             for p in sorted(Path(model_dir).rglob("*")) if p.is_file()}
    return cache_repo(cache, repo_id, files, **kwargs)
