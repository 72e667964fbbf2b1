"""vLLM's `FlexibleArgumentParser` (`vllm.utils.argparse_utils`, also `vllm.utils`): an
ArgumentParser that takes a long flag with underscores as well as dashes (`--max_model_len`
is `--max-model-len`), so scripts written for vLLM parse their command lines unchanged."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def dashed_flag(arg: str) -> str:
    """`--max_model_len=8` -> `--max-model-len=8`; values, short flags and positionals stay."""
    if not arg.startswith("--"):
        return arg
    key, eq, value = arg.partition("=")
    return key.replace("_", "-") + eq + value


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        if args is None:
            import sys

            args = sys.argv[1:]
        return super().parse_known_args([dashed_flag(a) for a in args], namespace)
