"""mrv2: an LLM inference engine built around a Model Runner V2 style runner."""

from mrv2.utils.disk_cache import key_numba_cache_to_sources

key_numba_cache_to_sources()  # before any module compiles (or loads) a cached kernel

from mrv2.config import ConfigError  # noqa: E402
from mrv2.engine.arg_utils import EngineArgs  # noqa: E402
from mrv2.entrypoints.llm import LLM  # noqa: E402
from mrv2.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,  # noqa: E402
                          Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput,
                          RequestOutputKind, ScoringOutput, ScoringRequestOutput)
from mrv2.pooling_params import PoolingParams  # noqa: E402
from mrv2.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestOutputKind", "CompletionOutput",
           "Logprob", "EngineArgs", "ConfigError", "PoolingParams", "PoolingOutput",
           "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "__version__"]
