"""`mrv2 serve --config x.yaml` (vLLM's; and its dotted `-cc.key=value` flags): a YAML mapping
of flag values by their long names (`max-model-len: 512` or `max_model_len: 512`). The file's
values become flags placed before the command line's, so the command line wins; a `model` in
the file is used only when the command line names none. An unknown key is refused, naming it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mrv2.entrypoints.openai.engine_flags import split_dotted

CONFIG_FLAG = "--config"


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with a `serve --config FILE`'s values spliced in after `serve`; unchanged without
    one. ValueError for an unreadable file or an unknown key."""
    if not argv or argv[0] != "serve":
        return argv
    argv = split_dotted(argv)
    path = _config_path(argv[1:])
    if path is None:
        return argv
    serve = _subparser(parser, "serve")
    values = _read_yaml(path)
    flags: list[str] = []
    model = values.pop("model", None)
    for key, value in values.items():
        flags += _as_flags(serve, path, str(key), value)
    if model is not None and not _names_model(serve, argv[1:]):
        flags += ["--model", str(model)]
    # --config again ends a last list-valued flag before the command line's own arguments.
    return [argv[0], *flags, CONFIG_FLAG, path, *argv[1:]]


def _config_path(args: list[str]) -> str | None:
    path = None
    for i, arg in enumerate(args):
        if arg == CONFIG_FLAG and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith(CONFIG_FLAG + "="):
            path = arg.split("=", 1)[1]
    return path


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(name)


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except OSError as error:
        raise ValueError(f"--config {path!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path!r}: not valid YAML ({error})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of flag names to values")
    return values


def _names_model(serve: argparse.ArgumentParser, args: list[str]) -> bool:
    """Whether the command line gives a model (positional or --model)."""
    if any(arg == "--model" or arg.startswith("--model=") for arg in args):
        return True
    try:
        parsed, _ = serve.parse_known_args(args)
    except SystemExit:
        return False
    return parsed.model_tag is not None


def _as_flags(serve: argparse.ArgumentParser, path: str, key: str, value: Any) -> list[str]:
    option = "--" + key.replace("_", "-")
    action = serve._option_string_actions.get(option)
    if action is None or option == CONFIG_FLAG:
        raise ValueError(f"--config {path!r}: unknown option {key!r} (no {option} flag)")
    if isinstance(action, argparse.BooleanOptionalAction):
        return [option if value else "--no-" + option[2:]]
    if action.nargs == 0:  # store_true / store_const
        if not isinstance(value, bool):
            raise ValueError(f"--config {path!r}: {key} takes true or false, got {value!r}")
        return [option] if value else []
    if isinstance(value, (dict, list)) and action.type is json.loads or isinstance(value, dict):
        return [option, json.dumps(value)]
    if isinstance(value, list):
        return [option, *map(str, value)]
    return [option, str(value)]
