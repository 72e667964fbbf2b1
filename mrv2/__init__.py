"""mrv2: an LLM inference engine built around a Model Runner V2 style runner."""

from mrv2.config import ConfigError
from mrv2.engine.arg_utils import EngineArgs
from mrv2.entrypoints.llm import LLM
from mrv2.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                          PoolingOutput, PoolingRequestOutput, RequestOutput, RequestOutputKind,
                          ScoringOutput, ScoringRequestOutput)
from mrv2.pooling_params import PoolingParams
from mrv2.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestOutputKind", "CompletionOutput",
           "Logprob", "EngineArgs", "ConfigError", "PoolingParams", "PoolingOutput",
           "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "__version__"]
