"""vLLM's import paths for its command-line helpers (`from vllm.utils import
FlexibleArgumentParser`), so a vLLM script changes only `vllm` to `mrv2`."""

from mrv2.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
