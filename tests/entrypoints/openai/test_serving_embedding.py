"""The embedding server's routes (`--runner pooling`): /v1/embeddings through the official
`openai` client (floats and base64) against transformers, /score and /rerank through httpx,
their errors in OpenAI's envelope, every answer validated against /openapi.json; and the
refusals of each runner's routes on the other's server.

The app runs in this process (FastAPI's TestClient, an httpx client, under the `openai`
client too) over a real AsyncLLM engine core process: the routes and the engine are the
server's, without a second server process to start."""

from __future__ import annotations

import base64
import copy
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.async_llm import AsyncLLM
from mrv2.entrypoints.openai.api_server import build_app
from mrv2.entrypoints.openai.cli_args import ServerConfig

from .conftest import API_KEY, MODEL_NAME

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # one KV block of the tiny model (fp32)
REF = "#/components/schemas/"


@pytest.fixture(scope="module")
def pooling_server(tiny_llama):
    engine = AsyncLLM.from_engine_args(EngineArgs(
        str(tiny_llama), runner="pooling", max_model_len=64, max_num_seqs=8,
        max_num_batched_tokens=32, kv_cache_memory_gb=40 * BLOCK_BYTES / (1 << 30)))
    app = build_app(engine, ServerConfig(model=str(tiny_llama), served_model_names=[MODEL_NAME],
                                         generation_config="vllm", api_key=API_KEY))
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            yield client
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def document(pooling_server):
    return pooling_server.get("/openapi.json").json()


def check(document, response, name: str, status: int = 200) -> dict:
    """The response's JSON, validated against components/schemas/`name` (closed models)."""
    assert response.status_code == status, response.text
    schemas = copy.deepcopy(document["components"]["schemas"])
    for schema in schemas.values():
        if schema.get("type") == "object" and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    body = response.json()
    jsonschema.Draft202012Validator({"$ref": REF + name, "components": {"schemas": schemas}}
                                    ).validate(body)
    return body


def test_embeddings_through_the_openai_client(pooling_server, document, tiny_llama):
    import openai
    from transformers import AutoModel, AutoTokenizer

    client = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY,
                           http_client=pooling_server, max_retries=0)
    texts = ["hello world", "a somewhat longer input, to be embedded in two chunks of prefill"]
    as_floats = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    as_base64 = client.embeddings.create(model=MODEL_NAME, input=texts)  # the SDK's default
    ids = [AutoTokenizer.from_pretrained(tiny_llama)(t).input_ids for t in texts]
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == sum(map(len, ids))
    model = AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for i, (floats, packed) in enumerate(zip(as_floats.data, as_base64.data)):
        assert floats.index == packed.index == i and floats.object == "embedding"
        assert np.array(packed.embedding, np.float32).tolist() == floats.embedding
        with torch.inference_mode():
            hidden = model(torch.tensor([ids[i]])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(floats.embedding),
                                   torch.nn.functional.normalize(hidden, dim=0), atol=2e-5,
                                   rtol=1e-4)
    # Token-id inputs, one or several; vLLM's normalize=false; base64 on the wire.
    one = client.embeddings.create(model=MODEL_NAME, input=ids[0], encoding_format="float")
    assert one.data[0].embedding == as_floats.data[0].embedding
    raw = check(document, pooling_server.post("/v1/embeddings", json={
        "model": MODEL_NAME, "input": ids, "encoding_format": "base64", "normalize": False,
        "truncate_prompt_tokens": 3}), "EmbeddingResponse")
    assert raw["object"] == "list" and raw["model"] == MODEL_NAME
    assert raw["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert len(vector) == len(one.data[0].embedding) and abs(np.linalg.norm(vector) - 1) > 1e-3


def test_score_and_rerank_are_cosine_similarities(pooling_server, document):
    body = check(document, pooling_server.post("/score", json={
        "model": MODEL_NAME, "text_1": "hello", "text_2": ["hello", "world", "hello"]}),
        "ScoreResponse")
    scores = [d["score"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    # The two "hello"s may share a step or not (requests arrive as the server reads them), and
    # the default mode's sums follow the batch: equal to float32 rounding, not to the bit.
    assert scores[0] == pytest.approx(1.0, abs=1e-5)
    assert scores[2] == pytest.approx(scores[0], abs=1e-6)
    assert scores[1] < 0.99
    for sides in ({"queries": "hello", "documents": ["hello", "world", "hello"]},
                  {"data_1": ["hello"] * 3, "data_2": ["hello", "world", "hello"]}):
        again = pooling_server.post("/v1/score", json=sides).json()
        assert [d["score"] for d in again["data"]] == pytest.approx(scores, abs=1e-6)
    documents = ["world", "hello", "hello world", "x"]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = check(document, pooling_server.post(path, json={
            "query": "hello", "documents": documents, "top_n": 3}), "RerankResponse")
        results = ranked["results"]
        assert len(results) == 3 and results[0]["index"] == 1
        assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)
        assert [r["relevance_score"] for r in results] == \
            sorted((r["relevance_score"] for r in results), reverse=True)
        assert all(r["document"]["text"] == documents[r["index"]] for r in results)
        assert ranked["usage"]["total_tokens"] > 0
    everything = pooling_server.post("/rerank", json={"query": "a", "documents": documents})
    assert len(everything.json()["results"]) == 4  # top_n 0: every document


@pytest.mark.parametrize("path, body, status, param, says", [
    ("/v1/embeddings", {"input": "hi", "dimensions": 3}, 400, "dimensions", "matryoshka"),
    ("/v1/embeddings", {"input": []}, 400, "input", "empty"),
    ("/v1/embeddings", {"input": [[5] * 64]}, 400, "input", "maximum context length"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", ""),
    ("/v1/embeddings", {"input": "hi", "model": "nope"}, 404, "model", "does not exist"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, None, "1:1, 1:N or N:N"),
    ("/score", {"text_1": "a"}, 400, None, "text_1 and text_2"),
    ("/rerank", {"query": "a", "documents": []}, 400, None, "at least one"),
    ("/v1/completions", {"prompt": "hi"}, 400, None, "does not support Completions API"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, None,
     "does not support Chat Completions API"),
    ("/v1/responses", {"input": "hi"}, 400, None, "does not support Responses API"),
])
def test_errors_are_openai_envelopes(pooling_server, document, path, body, status, param,
                                     says):
    error = check(document, pooling_server.post(path, json=body), "ErrorResponse",
                  status)["error"]
    assert says in error["message"] and error["param"] == param
    if path.endswith(("completions", "responses")):
        assert "--runner generate" in error["message"]


def test_embeddings_need_the_api_key(pooling_server):
    response = pooling_server.post("/v1/embeddings", json={"input": "hi"},
                                   headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401


def test_a_generate_server_refuses_the_pooling_routes():
    engine = SimpleNamespace(errored=False, get_tokenizer=lambda: None, config=SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=64, vocab_size=100, runner="generate")))
    client = TestClient(build_app(engine, ServerConfig(model="/m", served_model_names=["m"],
                                                       generation_config="vllm")))
    for path, body, api in (("/v1/embeddings", {"input": "hi"}, "Embeddings"),
                            ("/score", {"text_1": "a", "text_2": "b"}, "Score"),
                            ("/v1/rerank", {"query": "a", "documents": ["b"]}, "Rerank")):
        response = client.post(path, json=body)
        assert response.status_code == 400, path
        message = response.json()["error"]["message"]
        assert f"does not support {api} API" in message and "--runner pooling" in message
