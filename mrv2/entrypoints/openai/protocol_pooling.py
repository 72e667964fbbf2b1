"""Request and response bodies of the pooling routes of an embedding server (`--runner
pooling`): OpenAI's `/v1/embeddings`, and vLLM's `/score` and `/rerank` for embedding models.

Requests follow protocol.py's rules (unknown fields logged and ignored, null = the default);
the response models document /openapi.json only, as answer_schemas.py's do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictBool, model_validator

from mrv2.entrypoints.openai.openapi_rules import JsonInt
from mrv2.entrypoints.openai.protocol import INT64_MAX, OpenAIBaseModel, Prompt
from mrv2.pooling_params import PoolingParams

# vLLM's: -1 keeps as many tokens as the context takes, k >= 1 the last k.
TruncatePromptTokens = Annotated[int, Field(ge=-1, le=INT64_MAX)]
ScoreInputs = str | list[str]
# The field pairs a score request may name its two sides with (vLLM's spellings).
SCORE_SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"))


class EmbeddingRequest(OpenAIBaseModel):
    """OpenAI's embeddings request, with vLLM's extra fields."""

    input: Prompt
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: JsonInt | None = Field(None, ge=1, le=INT64_MAX)
    user: str | None = None
    # vLLM's extra parameters (the client's `extra_body`).
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    normalize: StrictBool | None = None
    add_special_tokens: StrictBool = True

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                             dimensions=self.dimensions, normalize=self.normalize,
                             task="embed")


class ScoreRequest(OpenAIBaseModel):
    """vLLM's score request: two sides, as text_1 / text_2, data_1 / data_2 or queries /
    documents; each a string or a list of strings (1 to 1, 1 to N or N to N)."""

    model: str | None = None
    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None
    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> "ScoreRequest":
        given = [pair for pair in SCORE_SIDES
                 if getattr(self, pair[0]) is not None or getattr(self, pair[1]) is not None]
        if len(given) != 1 or any(getattr(self, name) is None for name in given[0]):
            raise ValueError("give the two sides of the score as text_1 and text_2 (or "
                             "data_1 and data_2, or queries and documents)")
        return self

    def sides(self) -> tuple[ScoreInputs, ScoreInputs]:
        first, second = next(pair for pair in SCORE_SIDES if getattr(self, pair[0]) is not None)
        return getattr(self, first), getattr(self, second)


class RerankRequest(OpenAIBaseModel):
    """vLLM's (Jina / Cohere style) rerank request."""

    query: str
    documents: list[str]
    model: str | None = None
    top_n: JsonInt = Field(0, ge=0, le=INT64_MAX, description="0: every document")
    truncate_prompt_tokens: TruncatePromptTokens | None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"]
    embedding: list[float] | str = Field(
        description="floats, or with encoding_format base64 their little-endian float32 bytes")


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float = Field(description="cosine similarity of the two sides' embeddings")


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float = Field(description="cosine similarity to the query")


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    """The documents by relevance, best first (the first top_n when it is set)."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
