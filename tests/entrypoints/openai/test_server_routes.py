"""/ping, /load, CORS on the shared server; the dev-mode routes (VLLM_SERVER_DEV_MODE, as in
vLLM) on an in-process app with a stub engine; the request-side --max-logprobs check, request
logging and uvicorn's TLS settings."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from mrv2.entrypoints.openai.cli_args import ServerConfig
from mrv2.entrypoints.openai.errors import BadRequest, install_error_handlers
from mrv2.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from mrv2.entrypoints.openai.server_routes import (DEV_MODE_ENV, LoadTracker,
                                                   check_max_logprobs, install_server_routes,
                                                   log_request, uvicorn_settings)

from .conftest import MODEL_NAME


def test_ping_load_and_cors(server):
    for method in ("GET", "POST"):
        answer = httpx.request(method, f"{server.url}/ping")
        # An empty body typed as /openapi.json declares it (schemathesis checks the type).
        assert answer.status_code == 200 and answer.content == b""
        assert answer.headers["content-type"].startswith("text/plain")
    assert httpx.get(f"{server.url}/health").headers["content-type"].startswith("text/plain")
    # A wrong method is a 405 naming the allowed ones (RFC 9110), in OpenAI's envelope.
    wrong = httpx.delete(f"{server.url}/ping")
    assert wrong.status_code == 405 and set(wrong.headers["allow"].split(", ")) >= {"GET", "POST"}
    assert wrong.json()["error"]["message"] == "Method Not Allowed"
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    # A request counts while it runs (test_load_tracker_...); none are left after.
    client = server.client()
    client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, stream=False)
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    preflight = httpx.options(f"{server.url}/v1/models", headers={
        "Origin": "http://elsewhere", "Access-Control-Request-Method": "GET"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    # Dev routes exist only with VLLM_SERVER_DEV_MODE=1 (vLLM's choice).
    for method, path in (("GET", "/server_info"), ("POST", "/reset_prefix_cache"),
                         ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        assert httpx.request(method, f"{server.url}{path}").status_code == 404


class StubEngine:
    errored = False

    def __init__(self) -> None:
        self.config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))
        self.calls: list[str] = []

    async def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    async def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level={level}")
        self.calls.append(f"sleep {level}")

    async def wake_up(self, tags) -> None:
        self.calls.append(f"wake_up {tags}")

    async def is_sleeping(self) -> bool:
        return any(c.startswith("sleep") for c in self.calls)


def test_in_process_routes(monkeypatch):
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    engine, app = StubEngine(), FastAPI()
    install_error_handlers(app)
    install_server_routes(app, engine, ServerConfig(model="/m", served_model_names=["m"]))

    client = TestClient(app)
    assert client.get("/load").json() == {"server_load": 0}
    info = client.get("/server_info").json()
    assert "max_model_len=64" in info["vllm_config"] and "mrv2" in info["versions"]
    as_json = client.get("/server_info", params={"config_format": "json"}).json()
    assert json.dumps(as_json["vllm_config"]) and client.get(
        "/server_info", params={"config_format": "yaml"}).status_code == 400
    assert client.post("/reset_prefix_cache").json() == {"reset": True}
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/sleep", params={"level": 3}).status_code == 400
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert client.post("/wake_up", params={"tags": ["weights", "kv_cache"]}).status_code == 200
    assert engine.calls == ["reset_prefix_cache", "sleep 2", "wake_up ['weights', 'kv_cache']"]
    assert client.get("/ping").status_code == 200


def test_load_tracker_counts_requests_while_they_run():
    state = SimpleNamespace(server_load_metrics=0)
    seen = []

    async def inner(scope, receive, send):
        seen.append(state.server_load_metrics)

    tracker = LoadTracker(inner, state)
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        asyncio.run(tracker({"type": "http", "path": path}, None, None))
    assert seen == [1, 1, 0] and state.server_load_metrics == 0


def test_max_logprobs_logging_and_tls_settings(caplog):
    check_max_logprobs(CompletionRequest(prompt="x", logprobs=5), 5)
    check_max_logprobs(CompletionRequest(prompt="x", logprobs=20), None)
    for request, field in ((CompletionRequest(prompt="x", logprobs=6), "logprobs"),
                           (CompletionRequest(prompt="x", prompt_logprobs=6), "prompt_logprobs"),
                           (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                                  logprobs=True, top_logprobs=6),
                            "top_logprobs")):
        with pytest.raises(BadRequest, match=f"{field}=6 is greater than max allowed: 5"):
            check_max_logprobs(request, 5)
    config = ServerConfig(model="/m", served_model_names=["m"], enable_log_requests=True,
                          max_log_len=20, ssl_keyfile="k", ssl_certfile="c",
                          disable_uvicorn_access_log=True)
    with caplog.at_level(logging.INFO, logger="mrv2"):
        log_request(config, "/v1/completions", CompletionRequest(prompt="y" * 100))
    [record] = [r for r in caplog.records if "Received request" in r.getMessage()]
    assert record.getMessage() == 'Received request /v1/completions: {"prompt": "yyyyyyyy'
    settings = uvicorn_settings(config)
    assert (settings["ssl_keyfile"], settings["ssl_certfile"], settings["access_log"]) == \
        ("k", "c", False)
