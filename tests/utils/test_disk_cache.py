"""mrv2's on-disk cache root and numba's cache keyed to mrv2's source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mrv2.utils import disk_cache


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MRV2_CACHE_DIR", str(tmp_path / "c"))
    assert disk_cache.cache_root() == tmp_path / "c"
    monkeypatch.delenv("MRV2_CACHE_DIR")
    assert disk_cache.cache_root() == Path.home() / ".cache" / "mrv2"


def test_source_digest_changes_with_any_source_file(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not source")
    first = disk_cache.source_digest(tmp_path)
    assert disk_cache.source_digest(tmp_path) == first
    (tmp_path / "notes.txt").write_text("changed")
    assert disk_cache.source_digest(tmp_path) == first
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert disk_cache.source_digest(tmp_path) != first


def _numba_cache_dir_of_a_fresh_import(env: dict[str, str]) -> str:
    code = ("import mrv2, os\nfrom numba.core import config\n"
            "assert config.CACHE_DIR == os.environ['NUMBA_CACHE_DIR']\nprint(config.CACHE_DIR)")
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, text=True,
                          capture_output=True).stdout.strip()


def test_importing_mrv2_keys_numba_cache_to_the_sources(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["MRV2_CACHE_DIR"] = str(tmp_path)
    # Other versions' caches, last used 1 to 4 days ago: the most recent ones stay.
    others = [tmp_path / "numba" / f"{i:016x}" for i in range(4)]
    for days, other in enumerate(others, start=1):
        other.mkdir(parents=True)
        os.utime(other, (0, other.stat().st_mtime - days * 86400))
    used = Path(_numba_cache_dir_of_a_fresh_import(env))
    assert used == tmp_path / "numba" / disk_cache.source_digest() and used.is_dir()
    kept = disk_cache.KEPT_NUMBA_CACHES - 1
    assert [o.exists() for o in others] == [i < kept for i in range(len(others))]
    # Another start of the same version keeps them, and marks its own as the newest.
    before = used.stat().st_mtime
    os.utime(used, (0, before - 10 * 86400))
    assert Path(_numba_cache_dir_of_a_fresh_import(env)) == used
    assert used.stat().st_mtime >= before and sum(o.exists() for o in others) == kept


def test_a_numba_cache_dir_the_user_set_stands(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("MRV2_CACHE_DIR", str(tmp_path / "root"))
    assert disk_cache.key_numba_cache_to_sources() == str(tmp_path / "mine")
    assert not (tmp_path / "root").exists()


def test_an_unwritable_cache_root_leaves_numba_as_it_was(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("MRV2_CACHE_DIR", str(blocker))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert disk_cache.key_numba_cache_to_sources() is None
    assert "NUMBA_CACHE_DIR" not in os.environ
