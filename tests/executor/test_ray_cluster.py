"""executor/ray_cluster.py without a cluster: what a rank asks of its node, which variables
an actor carries over, and the install hint without Ray (the cluster itself:
tests/executor/test_ray_executor.py)."""

from __future__ import annotations

import builtins

import pytest

from executor import ray_cluster


def test_a_rank_asks_for_a_gpu_on_cuda_and_a_cpu_otherwise():
    assert ray_cluster.bundle_for("cuda") == {"GPU": 1.0}
    assert ray_cluster.bundle_for("cpu") == {"CPU": 1.0}


def test_the_engines_variables_travel_to_its_actors(monkeypatch):
    monkeypatch.setenv("MRV2_BATCH_INVARIANT", "1")
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/tmp/x")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("UNRELATED_SECRET", "no")
    env = ray_cluster.carried_env()
    assert env["MRV2_BATCH_INVARIANT"] == "1" and env["NUMBA_CACHE_DIR"] == "/tmp/x"
    assert env["OMP_NUM_THREADS"] == "3" and "UNRELATED_SECRET" not in env


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ImportError, match=r"pip install 'mrv2\[ray\]'"):
        ray_cluster.import_ray()


def test_a_running_cluster_is_found_by_its_address_file(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert not ray_cluster._cluster_running()
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")
    assert ray_cluster._cluster_running()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    (tmp_path / "ray" / "ray_current_cluster").unlink()
    assert ray_cluster._cluster_running()


class _FakeRay:
    def __init__(self, fail_auto: bool = False) -> None:
        self.addresses: list[str] = []
        self.fail_auto = fail_auto

    def is_initialized(self) -> bool:
        return False

    def init(self, address: str, **kwargs) -> None:
        self.addresses.append(address)
        if address == "auto" and self.fail_auto:
            raise ConnectionError("no cluster")


def test_only_an_announced_cluster_is_joined(monkeypatch, tmp_path):
    """Without RAY_ADDRESS or an address file, a local cluster is started, never one found by
    address="auto" (which also finds another program's head process running on the machine:
    a CI run joined another test worker's); a stale address file starts one too."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    fake = _FakeRay()
    monkeypatch.setattr(ray_cluster, "import_ray", lambda: fake)
    assert ray_cluster.join_or_start() is True and fake.addresses == ["local"]
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")
    fake.addresses = []
    assert ray_cluster.join_or_start() is False and fake.addresses == ["auto"]
    fake = _FakeRay(fail_auto=True)
    assert ray_cluster.join_or_start() is True and fake.addresses == ["auto", "local"]
