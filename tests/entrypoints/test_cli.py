"""`mrv2 generate`: completions, throughput line, and bad input as a clear error."""

from __future__ import annotations

import subprocess
import sys

from mrv2.entrypoints.cli import main


def test_generate_prints_completions_and_throughput(tiny_llama, capsys):
    code = main(["generate", "--model", str(tiny_llama), "--prompt", "hello", "--prompt",
                 "world", "--max-tokens", "5", "--ignore-eos", "--no-progress",
                 "--max-model-len", "64"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("Prompt: ") == 2 and "'hello'" in out and "'world'" in out
    assert out.count("(5 tokens, finish_reason=length)") == 2
    assert "Throughput: " in out and "output tokens/s" in out


def test_generate_takes_multi_step_decoding(tiny_llama, capsys, monkeypatch):
    """--num-scheduler-steps (the README's multi-step flag) reaches the engine: the same
    greedy text as one step at a time."""
    import mrv2.entrypoints.llm as llm_module

    seen = []
    real = llm_module.LLM.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("num_scheduler_steps"))
        real(self, *args, **kwargs)

    monkeypatch.setattr(llm_module.LLM, "__init__", spy)
    outs = []
    for steps in ("1", "4"):
        assert main(["generate", "--model", str(tiny_llama), "--prompt", "hello", "--max-tokens",
                     "9", "--ignore-eos", "--no-progress", "--max-model-len", "64",
                     "--num-scheduler-steps", steps]) == 0
        outs.append(capsys.readouterr().out.split("Throughput: ")[0])
    assert seen == [1, 4] and outs[0] == outs[1]


def test_bad_input_is_a_one_line_error(tiny_llama, capsys):
    code = main(["generate", "--model", str(tiny_llama), "--block-size", "24",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mrv2: error: ") and "block_size=24" in err
    assert "Traceback" not in err


def test_console_script_entry_point_runs(tmp_path):
    # The installed `mrv2` script resolves to the same main(); check the module form runs.
    result = subprocess.run([sys.executable, "-m", "mrv2.entrypoints.cli", "generate",
                             "--model", str(tmp_path / "missing")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "does not exist" in result.stderr or "not found" in result.stderr


def test_generate_without_a_model_chats_with_the_builtin_model(capsys):
    code = main(["generate", "--max-tokens", "12", "--no-progress", "--max-model-len", "256",
                 "--kv-cache-memory-gb", "0.05"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Using the built-in model SmolLM2-135M-Instruct" in out
    assert "Prompt: 'What is the capital of France?'" in out
    assert "Paris" in out.split("Prompt: ")[1]  # the first answer
    assert out.count("Prompt: ") == 4 and "Throughput: " in out


def test_checkpoint_flags_reach_the_engine_args():
    from mrv2.entrypoints.cli import build_parser
    from mrv2.entrypoints.openai.cli_args import engine_args_from

    args = build_parser().parse_args(
        ["serve", "org/model/file.gguf", "--tokenizer", "org/tok", "--hf-config-path", "cfg",
         "--revision", "v2", "--tokenizer-revision", "v3", "--download-dir", "/cache"])
    engine = engine_args_from(args, args.model_tag)
    assert (engine.model, engine.tokenizer, engine.hf_config_path, engine.revision,
            engine.tokenizer_revision, engine.download_dir) == (
        "org/model/file.gguf", "org/tok", "cfg", "v2", "v3", "/cache")
