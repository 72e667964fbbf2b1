"""A small byte-level BPE tokenizer, trained locally and cached on disk.

Tests and the demo need a real tokenizer without downloading one, so we train a byte-level BPE
(GPT-2 / Llama-3 style) on Python standard-library sources, which every machine has. Training is
deterministic (same corpus + parameters -> byte-identical ``tokenizer.json``) and takes well under
a second; the result is cached under ``$MRV2_CACHE_DIR/tokenizers/<key>/`` (default
``~/.cache/mrv2``), keyed by a hash of the parameters, the corpus bytes, the Python version and
the tokenizers version.

Every cache entry is published with one atomic directory rename, so concurrent test processes
either see a complete entry or none; a process that loses the race throws its copy away.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import sysconfig
import tempfile
import uuid
from pathlib import Path

import tokenizers
from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

from mrv2.utils.disk_cache import cache_root

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: bos=0, eos=1, pad=2, im_start=3, im_end=4 (trainer puts specials first).
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

DEFAULT_VOCAB_SIZE = 2048
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# ChatML without a leading bos: the encoder already prepends bos (add_special_tokens=True), and
# a template that also emitted it would double it on the common "render, then encode" path.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed, sorted stdlib files (~2.1 MB on 3.11). Files missing on some Python version are skipped;
# the corpus digest is part of the cache key, so a different corpus gives a different entry.
_CORPUS_FILES = (
    "argparse.py", "ast.py", "base64.py", "calendar.py", "codecs.py", "collections/__init__.py",
    "configparser.py", "contextlib.py", "dataclasses.py", "difflib.py", "email/message.py",
    "enum.py", "fractions.py", "functools.py", "gettext.py", "heapq.py", "http/client.py",
    "inspect.py", "json/decoder.py", "json/encoder.py", "locale.py", "logging/__init__.py",
    "optparse.py", "os.py", "pickle.py", "pprint.py", "random.py", "shutil.py", "socket.py",
    "statistics.py", "string.py", "subprocess.py", "tarfile.py", "textwrap.py", "threading.py",
    "tokenize.py", "traceback.py", "typing.py", "unittest/case.py", "urllib/parse.py", "uuid.py",
    "warnings.py", "weakref.py",
)
_MIN_CORPUS_BYTES = 500_000
_TOKENIZER_FILES_VERSION = 2  # bump when the produced files change for the same inputs


def make_temp_dir(final: Path) -> Path:
    """A fresh temp dir next to ``final`` (same filesystem, so the publishing rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-",
                                dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the published dir should read like any other
    return tmp


def publish_dir(tmp: Path, final: Path) -> bool:
    """Atomically rename ``tmp`` to ``final``. Returns False, leaving ``tmp`` for the caller to
    delete, if ``final`` is already a non-empty directory (e.g. another process won the race)."""
    try:
        os.rename(tmp, final)  # POSIX: replaces an empty dir, fails on a non-empty one
        return True
    except OSError:
        if not final.is_dir():
            raise
        return False


def _corpus_paths() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / name for name in _CORPUS_FILES if (stdlib / name).is_file()]


@functools.lru_cache(maxsize=None)
def _corpus_digest() -> str:
    h = hashlib.sha256()
    total = 0
    for p in _corpus_paths():
        data = p.read_bytes()
        total += len(data)
        h.update(p.name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    if total < _MIN_CORPUS_BYTES:
        raise RuntimeError(f"standard-library corpus too small ({total} bytes) to train a tokenizer")
    return h.hexdigest()


def tokenizer_key(vocab_size: int = DEFAULT_VOCAB_SIZE) -> str:
    """Cache key of the tokenizer that :func:`get_tokenizer_dir` returns for ``vocab_size``."""
    params = {
        "format": _TOKENIZER_FILES_VERSION, "vocab_size": vocab_size, "special": SPECIAL_TOKENS,
        "chat_template": CHAT_TEMPLATE, "corpus": _corpus_digest(),
        "python": platform.python_version(), "tokenizers": tokenizers.__version__,
    }
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
    return f"bpe{vocab_size}-{digest[:16]}"


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE on the stdlib corpus (deterministic; no caching)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must hold the 256 byte tokens + specials, got {vocab_size}")
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in _corpus_paths()]
    tok = Tokenizer(models.BPE())
    # ByteLevel maps every byte to a visible char, so any UTF-8 text encodes and decodes exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Merge order does not depend on thread scheduling (verified across fresh processes), but
    # training single-threaded removes any doubt and costs nothing at this corpus size.
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
    # Llama-3 style: encode(..., add_special_tokens=True) prepends bos.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, tok.token_to_id(BOS_TOKEN))],
    )
    return tok


def write_tokenizer_config(dst: Path, model_max_length: int) -> None:
    """Write ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``dst``."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
        # Explicitly none: Qwen2Tokenizer would otherwise add "<|endoftext|>" as a new unk token,
        # with an id past the model's vocab.
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": model_max_length,
        # Decoding must return exactly the encoded text (round-trip tests, detokenizer parity).
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    smap = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END]}
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


def get_tokenizer_dir(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Directory holding the cached tokenizer files (trains and publishes it on first use).

    The directory loads with ``transformers.AutoTokenizer.from_pretrained`` on its own.
    """
    final = cache_root() / "tokenizers" / tokenizer_key(vocab_size)
    if (final / "tokenizer.json").is_file():
        return final
    tmp = make_temp_dir(final)
    try:
        train_tokenizer(vocab_size).save(str(tmp / "tokenizer.json"), pretty=True)
        write_tokenizer_config(tmp, model_max_length=2048)
        publish_dir(tmp, final)  # losing the race is fine: the winner's files are identical
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _qwen2_pipeline(tok: Tokenizer) -> None:
    """Give ``tok`` the normalizer and pre-tokenizer that transformers' Qwen2Tokenizer builds.

    transformers 5 loads every ``model_type == "qwen2"`` directory with Qwen2Tokenizer whatever
    tokenizer_config.json says, and that class rebuilds the pipeline from vocab + merges (NFC +
    Qwen's split regex). Writing the same pipeline into tokenizer.json keeps the raw file and
    AutoTokenizer in agreement. Consequence, as for real Qwen2: non-NFC text is normalised.
    """
    try:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as regex
    except ImportError:  # same pattern, for transformers versions that lack the constant
        regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                 r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def copy_tokenizer(dst: Path, vocab_size: int = DEFAULT_VOCAB_SIZE, *,
                   model_max_length: int = 2048, qwen2_pipeline: bool = False) -> Tokenizer:
    """Put the tokenizer files into model dir ``dst``; returns the tokenizer as written.

    ``qwen2_pipeline`` must be set for qwen2 model dirs (see :func:`_qwen2_pipeline`).
    """
    src = get_tokenizer_dir(vocab_size)
    if qwen2_pipeline:
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
        _qwen2_pipeline(tok)
        tok.save(str(dst / "tokenizer.json"), pretty=True)
    else:
        shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
    write_tokenizer_config(dst, model_max_length)
    return Tokenizer.from_file(str(dst / "tokenizer.json"))
