"""`mrv2 serve --config x.yaml`: the file's values as flags, the command line winning."""

from __future__ import annotations

from mrv2.entrypoints.cli import build_parser, main
from mrv2.entrypoints.openai.cli_args import engine_args_from, resolve_model, server_config_from
from mrv2.entrypoints.openai.config_file import expand_config_file

YAML = """\
model: /from-yaml
max-model-len: 512
max_num_seqs: 8
enable-prefix-caching: false
served-model-name: [a, b]
compilation-config: {cudagraph_mode: FULL}
trust-remote-code: true
allowed-origins: ["http://x"]
"""


def parse(*argv: str):
    parser = build_parser()
    return parser.parse_args(expand_config_file(parser, list(argv)))


def test_values_from_the_file_and_the_command_line_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(YAML)
    args = parse("serve", "--config", str(path))
    model = resolve_model(args)
    engine, server = engine_args_from(args, model), server_config_from(args, model)
    assert model == "/from-yaml" and server.served_model_names == ["a", "b"]
    assert (engine.max_model_len, engine.max_num_seqs, engine.enable_prefix_caching) == \
        (512, 8, False)
    assert engine.compilation_config == {"cudagraph_mode": "FULL"}
    assert engine.trust_remote_code and server.allowed_origins == ["http://x"]
    args = parse("serve", "/cli", f"--config={path}", "--max-model-len", "64",
                 "--enable-prefix-caching")
    assert (resolve_model(args), args.max_model_len, args.enable_prefix_caching) == \
        ("/cli", 64, True)
    assert parse("serve", "--model", "/m", "--config", str(path)).model == "/m"


def test_bad_files_and_unknown_keys_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-model-len: 64\nno-such-flag: 1\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mrv2: error: ") and "no-such-flag" in err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    bad.write_text("- a list\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "mapping" in capsys.readouterr().err
