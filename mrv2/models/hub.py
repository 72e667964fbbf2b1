"""Resolving a `--model` / `--tokenizer` name to a local path, downloading Hub ids as vLLM does.

How to call it (EngineArgs / the CLI, before anything reads the model directory)::

    from mrv2.models.hub import resolve_model_path

    model_path = resolve_model_path(args.model, revision=args.revision,
                                    download_dir=args.download_dir)
    tokenizer_path = resolve_model_path(args.tokenizer or args.model,
                                        revision=args.tokenizer_revision or args.revision,
                                        download_dir=args.download_dir, what="tokenizer")

Every failure is a `ModelNotFoundError` (a ValueError, from mrv2.models.loader) whose message
names the name, the revision and the cache directory; nothing else is raised for a bad name.

Names, in the order they are tried:

* a path that exists (after `~` expansion): returned as given, `~` expanded (a relative path
  stays relative); nothing touches the network;
* `org/name/file.gguf` or `org/name/sub/dir/file.gguf`: one GGUF file of the Hub repo
  `org/name`, fetched with `hf_hub_download`; the local file path in the Hub cache is returned.
  A split GGUF (`...-00001-of-00003.gguf`, llama.cpp's shard naming) brings every shard into
  the same snapshot directory and returns the first shard's path, whichever shard was named;
* `org/name` (or a legacy one-part id such as `gpt2`): a safetensors repo, fetched with
  `snapshot_download` restricted to the files mrv2 reads (`MODEL_ALLOW_PATTERNS`, or
  `TOKENIZER_ALLOW_PATTERNS` for `what="tokenizer"`); the snapshot directory is returned;
* anything else (`./missing`, `/abs/missing`, `a/b/c`, a URL): `ModelNotFoundError` saying the
  path does not exist and is not a Hub id, without any network access.

The Hub environment is huggingface_hub's own: `HF_TOKEN` (nothing here passes a token, so it is
never overridden), `HF_ENDPOINT`, `HF_HUB_CACHE` / `HF_HOME` (the cache when `download_dir` is
None; `download_dir` is vLLM's `--download-dir`), and `HF_HUB_OFFLINE`. huggingface_hub reads
`HF_HUB_OFFLINE` once, at import; it is read again here at each call, and when set the call
passes `local_files_only=True`, so a process that sets it after importing huggingface_hub still
never reaches the network. Offline, a cached snapshot of the revision (a branch or tag through
`refs/<revision>`, or a commit hash) is used.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any, Callable, NoReturn

from mrv2.models.loader import ModelNotFoundError

# Files of a safetensors repo that mrv2 reads: weights (model.safetensors or the shards listed
# in model.safetensors.index.json), config.json / generation_config.json, and everything the
# tokenizer and chat template need (tokenizer.json, tokenizer_config.json,
# special_tokens_map.json, tokenizer.model, vocab/merges *.txt, *.tiktoken, *.jinja templates,
# also in additional_chat_templates/). No *.bin / *.pt / *.pth / *.gguf: mrv2 never reads them.
TOKENIZER_ALLOW_PATTERNS: tuple[str, ...] = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja")
MODEL_ALLOW_PATTERNS: tuple[str, ...] = ("*.safetensors",) + TOKENIZER_ALLOW_PATTERNS
# original/ holds Meta's consolidated checkpoints (vLLM ignores it too); consolidated*.safetensors
# is Mistral's native format next to the HF shards: mrv2's loader reads only the HF-format
# files, and skipping these halves the download of such repos. Hub patterns use fnmatch, where
# `*` also matches `/`.
MODEL_IGNORE_PATTERNS: tuple[str, ...] = ("original/*", "consolidated*.safetensors")

# llama.cpp's split naming: <stem>-00001-of-00003.gguf.
_SPLIT_GGUF = re.compile(r"^(?P<stem>.+)-(?P<index>\d+)-of-(?P<total>\d+)\.gguf$")
_TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})  # huggingface_hub's ENV_VARS_TRUE_VALUES


def resolve_model_path(model: str, *, revision: str | None = None,
                       download_dir: str | None = None,
                       what: str = "model") -> str:
    """The local path of `model`: a path that exists, or a Hub id downloaded into the cache.

    `revision` (a branch, tag or commit hash; None is the repo's default branch) and
    `download_dir` (the Hub cache directory; None is huggingface_hub's default) apply only to
    Hub ids. `what="tokenizer"` downloads only the config and tokenizer files of a repo.
    Raises ModelNotFoundError when the name is neither an existing path nor a Hub id that
    can be resolved (see the module docstring).
    """
    if what not in ("model", "tokenizer"):
        raise ValueError(f"what={what!r}: expected 'model' or 'tokenizer'")
    path = os.path.expanduser(model)
    if model and os.path.exists(path):
        return path
    repo_id, filename = _split_hub_name(model)
    if repo_id is None:
        raise ModelNotFoundError(
            f"{what} {model!r} does not exist as a local path and is not a Hugging Face Hub id "
            f"('org/name' or 'org/name/file.gguf')")
    target = _Target(what, model, repo_id, filename, revision, download_dir)
    if filename is None:
        patterns = MODEL_ALLOW_PATTERNS if what == "model" else TOKENIZER_ALLOW_PATTERNS
        snapshot = target.call(_hub().snapshot_download, allow_patterns=list(patterns),
                               ignore_patterns=list(MODEL_IGNORE_PATTERNS))
        # A repo without config.json (a GGUF-only repo, most often) yields an empty snapshot;
        # said here, where the repo is known, rather than later as "no config.json in <dir>".
        if what == "model" and not os.path.isfile(os.path.join(snapshot, "config.json")):
            target.fail(f"the snapshot {snapshot} has no config.json: not a Hugging Face "
                        f"safetensors model repo (a GGUF file is named org/name/file.gguf)")
        return snapshot
    shards = _gguf_shards(filename)
    if len(shards) == 1:
        return target.call(_hub().hf_hub_download, filename=filename)
    return _download_split_gguf(target, shards)


class _Target:
    """One Hub lookup (repo, optional file, revision, cache) and its error messages."""

    def __init__(self, what: str, model: str, repo_id: str, filename: str | None,
                 revision: str | None, download_dir: str | None) -> None:
        self.what, self.model, self.repo_id, self.filename = what, model, repo_id, filename
        self.revision, self.download_dir = revision, download_dir

    def call(self, fn: Callable[..., str], **kwargs: Any) -> str:
        # Only the arguments below: token / endpoint stay huggingface_hub's (HF_TOKEN,
        # HF_ENDPOINT); cache_dir=None is its default cache.
        try:
            return fn(repo_id=self.repo_id, revision=self.revision,
                      cache_dir=self.download_dir, local_files_only=hub_offline(), **kwargs)
        except Exception as e:  # noqa: BLE001 - Hub / network errors translated, others re-raised
            reason = _reason(e)
            if reason is None:
                raise
            raise ModelNotFoundError(f"{self.describe()}: {reason}") from e

    @property
    def cache_dir(self) -> str:
        if self.download_dir is not None:
            return self.download_dir
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)

    def describe(self) -> str:
        where = (f"Hub repo {self.repo_id!r}" if self.filename is None
                 else f"file {self.filename!r} of Hub repo {self.repo_id!r}")
        revision = repr(self.revision) if self.revision is not None else "default (main)"
        return f"{self.what} {self.model!r}: {where}, revision {revision}, cache {self.cache_dir}"

    def fail(self, reason: str) -> NoReturn:
        raise ModelNotFoundError(f"{self.describe()}: {reason}")


def _reason(e: Exception) -> str | None:
    """Why a Hub lookup failed, for a Hub or network error; None for any other error."""
    from huggingface_hub import errors

    # Subclasses before their bases: IncompleteSnapshot < LocalEntryNotFound < EntryNotFound,
    # Gated < RepositoryNotFound < HfHubHTTPError.
    incomplete = getattr(errors, "IncompleteSnapshotError", None)
    if incomplete is not None and isinstance(e, incomplete):
        return f"the cached snapshot is incomplete and cannot be completed now: {_first_line(e)}"
    if isinstance(e, errors.LocalEntryNotFoundError):
        if hub_offline():
            return ("not in the cache and the Hub is offline (HF_HUB_OFFLINE is set); download "
                    "it once with network access, or point download_dir (--download-dir) at "
                    "the cache that holds it")
        return f"not in the cache and the Hub could not be reached: {_first_line(e)}"
    if isinstance(e, errors.GatedRepoError):
        return ("the repo is gated: accept its conditions on huggingface.co and set HF_TOKEN "
                "to a token of an account that has access")
    if isinstance(e, errors.RepositoryNotFoundError):
        return ("the repo does not exist on the Hub, or it is private and HF_TOKEN is not set "
                "to a token with access to it")
    if isinstance(e, errors.RevisionNotFoundError):
        return "the repo has no such revision (branch, tag or commit)"
    if isinstance(e, errors.EntryNotFoundError):
        return "the repo has no such file at this revision"
    if isinstance(e, errors.HFValidationError):
        return f"invalid Hub argument: {_first_line(e)}"
    if isinstance(e, errors.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return f"access denied (HTTP {status}): set HF_TOKEN to a token with access to the repo"
        return f"the Hub answered with an error: {_first_line(e)}"
    if isinstance(e, _network_errors()):
        return f"network error while downloading: {type(e).__name__}: {_first_line(e)}"
    return None


def hub_offline() -> bool:
    """Whether the Hub is offline: HF_HUB_OFFLINE as huggingface_hub read it at import, or as
    the environment holds it now (huggingface_hub's rule: HF_HUB_OFFLINE, else
    TRANSFORMERS_OFFLINE)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return bool(constants.HF_HUB_OFFLINE) or (value or "").upper() in _TRUE_VALUES


def _split_hub_name(name: str) -> tuple[str | None, str | None]:
    """(repo_id, filename in the repo or None); (None, None) when `name` is no Hub id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    parts = name.split("/")
    if len(parts) >= 3 and name.endswith(".gguf"):
        repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
        if any(p in ("", ".", "..") for p in parts[2:]):
            return None, None
    else:
        repo_id, filename = name, None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None, None
    return repo_id, filename


def _gguf_shards(filename: str) -> list[str]:
    """Every shard of a split GGUF, first shard first; [filename] for a single-file GGUF."""
    match = _SPLIT_GGUF.match(filename)
    if match is None:
        return [filename]
    total, width = int(match["total"]), len(match["index"])
    if not 1 <= int(match["index"]) <= total:
        return [filename]
    return [f"{match['stem']}-{i:0{width}d}-of-{match['total']}.gguf" for i in range(1, total + 1)]


def _download_split_gguf(target: _Target, shards: list[str]) -> str:
    # One snapshot_download for all shards: a single commit is resolved, so every shard lands
    # in the same snapshot directory (a GGUF reader finds the others next to the first).
    # glob.escape: the names are literal, but allow_patterns are fnmatch patterns.
    snapshot = target.call(_hub().snapshot_download,
                           allow_patterns=[glob.escape(s) for s in shards])
    missing = [s for s in shards if not os.path.isfile(os.path.join(snapshot, s))]
    if missing:
        offline = " and the Hub is offline (HF_HUB_OFFLINE is set)" if hub_offline() else ""
        target.fail(f"{len(missing)} of the {len(shards)} GGUF shards are not in the snapshot "
                    f"{snapshot}{offline}: {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return os.path.join(snapshot, shards[0])


def _hub() -> Any:
    # Imported at call time: `from huggingface_hub import snapshot_download` costs ~0.3 s, paid
    # only when a Hub id is resolved; tests monkeypatch the attributes of this module object.
    import huggingface_hub

    return huggingface_hub


def _network_errors() -> tuple[type[BaseException], ...]:
    """Transport errors of the HTTP client huggingface_hub uses (httpx2 since 1.x, requests
    before); the connection errors it catches itself come back as LocalEntryNotFoundError."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("httpx2", "HTTPError"), ("requests", "RequestException")):
        try:
            types.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["MODEL_ALLOW_PATTERNS", "MODEL_IGNORE_PATTERNS", "ModelNotFoundError",
           "TOKENIZER_ALLOW_PATTERNS", "hub_offline", "resolve_model_path"]
