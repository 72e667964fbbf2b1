"""resolve_model_path: local paths, Hub ids through a hand-built Hub cache, and the online path's
arguments and errors with huggingface_hub's download functions replaced. Nothing touches the
network: every test either runs offline (HF_HUB_OFFLINE) or replaces the download functions.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import constants, errors

from mrv2.models.hub import (MODEL_ALLOW_PATTERNS, TOKENIZER_ALLOW_PATTERNS, hub_offline,
                             resolve_model_path)
from mrv2.models.loader import ModelNotFoundError, load_hf_config
from mrv2.testing.hub_cache import COMMIT_MAIN, cache_repo

COMMIT_V2 = "b" * 40
CONFIG = b'{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}'


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "hub-cache"
    path.mkdir()
    return path


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1 as if set before huggingface_hub was imported (its constant), so even
    huggingface_hub's own HTTP session refuses to connect."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Replace huggingface_hub's download functions (the module attributes hub.py calls) with
    recorders; snapshot_download returns a directory holding a config.json."""
    recorded: list[tuple[str, dict[str, Any]]] = []
    snapshot = tmp_path / "fake-snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_bytes(CONFIG)

    def snapshot_download(**kwargs: Any) -> str:
        recorded.append(("snapshot_download", kwargs))
        return str(snapshot)

    def hf_hub_download(**kwargs: Any) -> str:
        recorded.append(("hf_hub_download", kwargs))
        return str(snapshot / kwargs["filename"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return recorded


# --- local paths -------------------------------------------------------------------------------

def test_local_paths_pass_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  calls: list) -> None:
    model_dir = tmp_path / "org" / "name"  # looks like a Hub id relative to tmp_path
    model_dir.mkdir(parents=True)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_path(str(model_dir)) == str(model_dir)
    assert resolve_model_path(str(gguf)) == str(gguf)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/name") == "org/name"  # an existing path wins over the Hub
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_path("~/model.gguf", what="tokenizer") == str(gguf)
    assert calls == []


@pytest.mark.parametrize("name", ["./missing/dir", "/abs/missing", "a/b/c", "org/name/sub/",
                                  "https://huggingface.co/org/name", "~/missing", "",
                                  "org/name/../x.gguf", "org--x/name", "-org/name"])
def test_invalid_names_fail_without_network(name: str, calls: list) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist as a local path and is not a "
                                                 "Hugging Face Hub id") as info:
        resolve_model_path(name)
    assert repr(name) in str(info.value)
    assert calls == []


def test_what_is_checked() -> None:
    with pytest.raises(ValueError, match="what='weights'"):
        resolve_model_path("org/name", what="weights")


# --- the Hub cache, offline --------------------------------------------------------------------

def test_repo_id_resolves_to_cached_snapshot(cache: Path, offline: None) -> None:
    snapshot = cache_repo(cache, "org/name", {"config.json": CONFIG, "model.safetensors": b"w"})
    resolved = resolve_model_path("org/name", download_dir=str(cache))
    assert Path(resolved) == snapshot
    assert (Path(resolved) / "model.safetensors").read_bytes() == b"w"  # through the blob link


def test_plain_files_in_snapshot_are_accepted(cache: Path, offline: None) -> None:
    snapshot = cache_repo(cache, "org/name", {"config.json": CONFIG}, symlinks=False)
    assert Path(resolve_model_path("org/name", download_dir=str(cache))) == snapshot


def test_default_cache_is_huggingface_hubs(cache: Path, offline: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # HF_HUB_CACHE is read by huggingface_hub at import, into constants.HF_HUB_CACHE.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    snapshot = cache_repo(cache, "org/name", {"config.json": CONFIG})
    assert Path(resolve_model_path("org/name")) == snapshot
    with pytest.raises(ModelNotFoundError, match=f"cache {cache}"):
        resolve_model_path("org/other")


def test_revision_selects_snapshot(cache: Path, offline: None) -> None:
    main = cache_repo(cache, "org/name", {"config.json": CONFIG}, commit=COMMIT_MAIN)
    v2 = cache_repo(cache, "org/name", {"config.json": CONFIG + b" "}, commit=COMMIT_V2,
                    refs=("v2",))
    assert Path(resolve_model_path("org/name", download_dir=str(cache))) == main
    assert Path(resolve_model_path("org/name", revision="v2", download_dir=str(cache))) == v2
    assert Path(resolve_model_path("org/name", revision=COMMIT_V2,
                                   download_dir=str(cache))) == v2


def test_gguf_file_in_repo(cache: Path, offline: None) -> None:
    snapshot = cache_repo(cache, "org/name-GGUF", {"model-Q4_K_M.gguf": b"GGUF1",
                                                   "sub/dir/model-Q8_0.gguf": b"GGUF2"})
    resolved = resolve_model_path("org/name-GGUF/model-Q4_K_M.gguf", download_dir=str(cache))
    assert Path(resolved) == snapshot / "model-Q4_K_M.gguf"
    assert Path(resolved).read_bytes() == b"GGUF1"
    resolved = resolve_model_path("org/name-GGUF/sub/dir/model-Q8_0.gguf",
                                  download_dir=str(cache))
    assert Path(resolved) == snapshot / "sub" / "dir" / "model-Q8_0.gguf"


def test_split_gguf_resolves_to_first_shard(cache: Path, offline: None) -> None:
    shards = {f"q4/model-Q4_K_M-{i:05d}-of-00003.gguf": b"GGUF%d" % i for i in (1, 2, 3)}
    snapshot = cache_repo(cache, "org/big-GGUF", shards)
    first = snapshot / "q4" / "model-Q4_K_M-00001-of-00003.gguf"
    for named in (1, 3):  # naming a later shard still gives the first
        resolved = resolve_model_path(f"org/big-GGUF/q4/model-Q4_K_M-{named:05d}-of-00003.gguf",
                                      download_dir=str(cache))
        assert Path(resolved) == first
    assert sorted(p.name for p in first.parent.iterdir()) == sorted(
        Path(name).name for name in shards)


def test_split_gguf_with_missing_shard_fails(cache: Path, offline: None) -> None:
    cache_repo(cache, "org/big-GGUF", {"m-00001-of-00002.gguf": b"GGUF"})
    with pytest.raises(ModelNotFoundError, match=r"1 of the 2 GGUF shards.*offline.*"
                                                 r"m-00002-of-00002\.gguf"):
        resolve_model_path("org/big-GGUF/m-00001-of-00002.gguf", download_dir=str(cache))


@pytest.mark.parametrize("name, revision, names", [
    ("org/missing", None, ["'org/missing'", "default (main)"]),
    ("org/name", "v9", ["'org/name'", "revision 'v9'"]),
    ("org/name", "c" * 40, ["'org/name'", f"revision '{'c' * 40}'"]),
    ("org/name/absent.gguf", None, ["'absent.gguf'", "'org/name'"]),
    ("org/name/absent-00001-of-00002.gguf", None, ["'absent-00001-of-00002.gguf'"]),
])
def test_uncached_id_revision_or_file_fails_offline(cache: Path, offline: None, name: str,
                                                    revision: str | None,
                                                    names: list[str]) -> None:
    cache_repo(cache, "org/name", {"config.json": CONFIG})
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path(name, revision=revision, download_dir=str(cache))
    message = str(info.value)
    for expected in names + [repr(name), f"cache {cache}", "offline", "HF_HUB_OFFLINE"]:
        assert expected in message, (expected, message)


def test_repo_without_config_json_fails(cache: Path, offline: None) -> None:
    cache_repo(cache, "org/only-GGUF", {"README.md": b"# gguf"})
    with pytest.raises(ModelNotFoundError, match="no config.json.*org/name/file.gguf"):
        resolve_model_path("org/only-GGUF", download_dir=str(cache))
    # A tokenizer repo needs no config.json.
    assert resolve_model_path("org/only-GGUF", download_dir=str(cache), what="tokenizer")


def test_real_tiny_model_from_cache_loads(cache: Path, offline: None, tiny_llama: Path) -> None:
    files = {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()}
    snapshot = cache_repo(cache, "mrv2/tiny-llama", files)
    resolved = resolve_model_path("mrv2/tiny-llama", download_dir=str(cache))
    assert Path(resolved) == snapshot
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolved)
    assert config.architectures == ["LlamaForCausalLM"]
    assert load_hf_config(resolved).hidden_size == config.hidden_size
    shutil.rmtree(cache / "models--mrv2--tiny-llama" / "blobs")  # links now dangle
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path("mrv2/tiny-llama", download_dir=str(cache))


# --- the online path, with the download functions replaced ------------------------------------

def test_online_snapshot_arguments(calls: list) -> None:
    resolve_model_path("org/name", revision="v2", download_dir="/dl")
    resolve_model_path("org/name", what="tokenizer")
    (fn, model_kwargs), (_, tok_kwargs) = calls
    assert fn == "snapshot_download"
    assert model_kwargs["repo_id"] == "org/name"
    assert model_kwargs["revision"] == "v2" and model_kwargs["cache_dir"] == "/dl"
    assert model_kwargs["local_files_only"] is False
    assert "token" not in model_kwargs and "endpoint" not in model_kwargs  # HF_TOKEN honoured
    assert model_kwargs["allow_patterns"] == list(MODEL_ALLOW_PATTERNS)
    assert "original/*" in model_kwargs["ignore_patterns"]
    assert tok_kwargs["allow_patterns"] == list(TOKENIZER_ALLOW_PATTERNS)
    assert tok_kwargs["revision"] is None and tok_kwargs["cache_dir"] is None

    wanted = ["config.json", "generation_config.json", "model.safetensors.index.json",
              "model-00001-of-00002.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "merges.txt", "vocab.json",
              "qwen.tiktoken", "chat_template.jinja", "additional_chat_templates/tool.jinja"]
    unwanted = ["pytorch_model.bin", "model.pt", "consolidated.00.pth", "model-Q4_K_M.gguf",
                "original/params.json", "original/tokenizer.model", "consolidated.safetensors",
                "README.md", ".gitattributes"]
    kept = set(huggingface_hub.utils.filter_repo_objects(
        wanted + unwanted, allow_patterns=model_kwargs["allow_patterns"],
        ignore_patterns=model_kwargs["ignore_patterns"]))
    assert kept == set(wanted)
    kept = set(huggingface_hub.utils.filter_repo_objects(
        wanted, allow_patterns=tok_kwargs["allow_patterns"],
        ignore_patterns=tok_kwargs["ignore_patterns"]))
    assert not any(name.endswith(".safetensors") for name in kept)
    assert {"config.json", "tokenizer.json", "tokenizer.model", "merges.txt"} <= kept


def test_online_gguf_arguments(calls: list, tmp_path: Path) -> None:
    resolved = resolve_model_path("org/name-GGUF/sub/model.gguf", revision="main",
                                  download_dir="/dl")
    fn, kwargs = calls[0]
    assert fn == "hf_hub_download"
    assert kwargs == {"repo_id": "org/name-GGUF", "filename": "sub/model.gguf",
                      "revision": "main", "cache_dir": "/dl", "local_files_only": False}
    assert resolved.endswith("sub/model.gguf")

    shards = [f"m[1]-{i:05d}-of-00002.gguf" for i in (1, 2)]
    for shard in shards:
        (tmp_path / "fake-snapshot" / shard).write_bytes(b"GGUF")
    resolved = resolve_model_path(f"org/name-GGUF/{shards[0]}")
    fn, kwargs = calls[1]
    assert fn == "snapshot_download" and kwargs["repo_id"] == "org/name-GGUF"
    # One call, one commit; the names are escaped for fnmatch ('[1]' is literal).
    assert list(huggingface_hub.utils.filter_repo_objects(
        shards + ["m1-00001-of-00002.gguf"], allow_patterns=kwargs["allow_patterns"])) == shards
    assert resolved == str(tmp_path / "fake-snapshot" / shards[0])


def test_offline_env_set_after_import_is_honoured(calls: list,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert not hub_offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # huggingface_hub's constant is still False
    assert hub_offline()
    resolve_model_path("org/name")
    resolve_model_path("org/name/model.gguf")
    assert [kwargs["local_files_only"] for _, kwargs in calls] == [True, True]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # HF_HUB_OFFLINE, when set, decides
    assert not hub_offline()


def _http_error(cls: type, status: int) -> Exception:
    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/name")
    return cls(f"{status} Client Error", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize("error, expected", [
    (lambda: _http_error(errors.GatedRepoError, 401), "gated.*HF_TOKEN"),
    (lambda: _http_error(errors.RepositoryNotFoundError, 401), "does not exist.*HF_TOKEN"),
    (lambda: _http_error(errors.RevisionNotFoundError, 404), "no such revision"),
    (lambda: _http_error(errors.RemoteEntryNotFoundError, 404), "no such file"),
    (lambda: _http_error(errors.HfHubHTTPError, 403), "HTTP 403.*HF_TOKEN"),
    (lambda: _http_error(errors.HfHubHTTPError, 500), "the Hub answered with an error"),
    (lambda: errors.LocalEntryNotFoundError("connection refused"), "could not be reached"),
    (lambda: httpx2.ReadTimeout("read timed out"), "network error.*ReadTimeout"),
    (lambda: httpx2.ProxyError("bad proxy"), "network error.*ProxyError"),
])
def test_online_errors_become_model_not_found(calls: list, monkeypatch: pytest.MonkeyPatch,
                                              error: Any, expected: str) -> None:
    def failing(**kwargs: Any) -> str:
        raise error()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", failing)
    for name in ("org/name", "org/name/model.gguf"):
        with pytest.raises(ModelNotFoundError, match=expected) as info:
            resolve_model_path(name, revision="v2", download_dir="/dl")
        assert "'org/name'" in str(info.value) and "'v2'" in str(info.value)
        assert isinstance(info.value.__cause__, Exception)


def test_other_errors_propagate(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(**kwargs: Any) -> str:
        raise RuntimeError("a bug, not a missing model")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(RuntimeError, match="a bug"):
        resolve_model_path("org/name")


def test_offline_env_alone_uses_the_real_cache(cache: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the environment variable, set after huggingface_hub read it: the real
    # snapshot_download / hf_hub_download must still stay off the network.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cache_repo(cache, "org/name", {"config.json": CONFIG, "f.gguf": b"GGUF"})
    assert Path(resolve_model_path("org/name", download_dir=str(cache))) == snapshot
    assert Path(resolve_model_path("org/name/f.gguf", download_dir=str(cache))) == (
        snapshot / "f.gguf")
    with pytest.raises(ModelNotFoundError, match="'org/absent'.*offline"):
        resolve_model_path("org/absent", download_dir=str(cache))
