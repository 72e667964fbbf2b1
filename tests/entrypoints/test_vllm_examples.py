"""Scripts written against vLLM's offline API (tests/entrypoints/vllm_examples/, in the
patterns of vLLM's examples/offline_inference: FlexibleArgumentParser, EngineArgs.add_cli_args,
LLM(**vars(args)), generate / chat / logprobs / beam_search / embed) run on mrv2 with only their
imports changed from `vllm` to `mrv2`."""

from __future__ import annotations

import ast
import re
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent / "vllm_examples"
VLLM_IMPORT = re.compile(r"^(from|import) vllm\b", re.MULTILINE)


def as_mrv2(script: Path, tmp_path: Path) -> Path:
    """The script with `vllm` -> `mrv2` in its import lines, and no other change."""
    text = script.read_text()
    assert VLLM_IMPORT.search(text), f"{script.name} does not import vllm"
    ported = VLLM_IMPORT.sub(lambda m: f"{m.group(1)} mrv2", text)
    changed = [(a, b) for a, b in zip(text.splitlines(), ported.splitlines()) if a != b]
    assert all(VLLM_IMPORT.match(a) for a, _ in changed)
    out = tmp_path / script.name
    out.write_text(ported)
    return out


def run_example(name: str, tmp_path: Path, monkeypatch, capsys, *args: str) -> str:
    script = as_mrv2(EXAMPLES / name, tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr().out


@pytest.fixture
def engine_flags(tiny_llama) -> list[str]:
    # Underscores as well as dashes, as vLLM's parser takes them.
    return ["--model", str(tiny_llama), "--max_model_len", "256", "--max-num-seqs", "8",
            "--kv-cache-memory-gb=0.02", "--no-enable-prefix-caching"]


def test_basic(tmp_path, monkeypatch, capsys, engine_flags):
    out = run_example("basic.py", tmp_path, monkeypatch, capsys, *engine_flags)
    assert out.count("Generated text: ") == 4 and "'The capital of France is'" in out


def test_generate_with_default_params_overridden(tmp_path, monkeypatch, capsys, engine_flags):
    out = run_example("generate.py", tmp_path, monkeypatch, capsys, *engine_flags,
                      "--max-tokens", "4", "--temperature", "0", "--top-k", "5")
    assert out.count("Generated text: ") == 2


def test_chat_batches_and_a_template_file(tmp_path, monkeypatch, capsys, engine_flags):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    out = run_example("chat.py", tmp_path, monkeypatch, capsys, *engine_flags,
                      "--max-tokens", "4", "--chat-template-path", str(template))
    assert "4 conversations answered" in out
    assert "with the template: '[system] You are a helpful assistant\\n" in out


def test_logprobs_and_per_prompt_params(tmp_path, monkeypatch, capsys, engine_flags):
    out = run_example("logprobs.py", tmp_path, monkeypatch, capsys, *engine_flags)
    assert out.count("rank ") == 8 and "prompt logprobs: " in out
    assert "positions, the first is None" in out  # vLLM: the first prompt token has none


def test_beam_search(tmp_path, monkeypatch, capsys, engine_flags):
    out = run_example("beam_search.py", tmp_path, monkeypatch, capsys, *engine_flags)
    assert out.count("cumulative logprob") == 6


def test_the_script_is_only_re_imported(tmp_path):
    ported = as_mrv2(EXAMPLES / "basic.py", tmp_path).read_text()
    assert "from mrv2 import LLM, EngineArgs, SamplingParams" in ported
    code = [line for line in ported.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if "vllm" in line]


def test_embed_and_score(tmp_path, monkeypatch, capsys, engine_flags):
    out = run_example("embed.py", tmp_path, monkeypatch, capsys, *engine_flags)
    assert out.count("Embeddings: [") == 4 and out.count("(size=64)") == 4
    scores = ast.literal_eval(out.split("Scores: ")[1].strip())  # two cosines
    assert len(scores) == 2 and all(-1.0 <= s <= 1.0 for s in scores)
