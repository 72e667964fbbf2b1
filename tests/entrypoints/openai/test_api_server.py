"""The small endpoints (models, version, tokenize, detokenize, health), the server flags
(--generation-config, --chat-template, --served-model-name), a dead engine (503) and a client
that leaves before its body is read (499, nothing logged)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

import mrv2

from .conftest import MAX_MODEL_LEN, MODEL_NAME, RemoteServer

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


def test_models_and_version(server, client):
    [card] = client.models.list().data
    assert card.id == MODEL_NAME and card.object == "model" and card.owned_by == "mrv2"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/version").json() == {"version": mrv2.__version__}
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenize_and_detokenize(server, tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    out = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert out["tokens"] == tokenizer("hello world").input_ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    bare = httpx.post(f"{server.url}/tokenize",
                      json={"prompt": "hello world", "add_special_tokens": False,
                            "return_token_strs": True}).json()
    assert bare["tokens"] == out["tokens"][1:]
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    chat = httpx.post(f"{server.url}/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat["tokens"] == tokenizer(rendered).input_ids
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": bare["tokens"]}).json()
    assert text == {"prompt": "hello world"}


@pytest.fixture(scope="module")
def custom_model(tiny_llama, tmp_path_factory):
    """A model copy whose generation_config.json makes sampling greedy and caps max_tokens at
    3, and a chat template file next to it."""
    root = tmp_path_factory.mktemp("custom")
    model = root / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(max_new_tokens=3, temperature=0.0)
    (model / "generation_config.json").write_text(json.dumps(config))
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    return model, template


@pytest.fixture(scope="module")
def custom_server(custom_model):
    """The custom model, its chat template file, two served names and no API key. Killed by
    the last test."""
    model, template = custom_model
    remote = RemoteServer(model, ["--max-model-len", "128", "--served-model-name", "a", "b",
                                  "--chat-template", str(template),
                                  "--generation-config", "auto", "--no-async-scheduling",
                                  "--uvicorn-log-level", "warning"])
    yield remote
    remote.stop()


def test_generation_config_defaults_and_chat_template(custom_server, tiny_llama):
    client = custom_server.client(api_key="unused")
    assert [m.id for m in client.models.list().data] == ["a", "b"]
    messages = [{"role": "user", "content": "hi"}]
    # No max_tokens and no temperature: max_new_tokens=3 and greedy from generation_config.
    first = client.chat.completions.create(model="b", messages=messages,
                                           extra_body={"ignore_eos": True})
    assert first.model == "a" and first.usage.completion_tokens == 3
    again = client.chat.completions.create(model="a", messages=messages,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == first.choices[0].message.content
    # The request's own values win, except that max_new_tokens caps max_tokens (as in vLLM).
    sampled = client.chat.completions.create(model="a", messages=messages, temperature=1.0,
                                             seed=3, n=2, max_tokens=5,
                                             extra_body={"ignore_eos": True})
    assert sampled.choices[0].message.content != sampled.choices[1].message.content
    assert sampled.usage.completion_tokens == 2 * 3
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert first.usage.prompt_tokens == len(tokenizer("<<hi>>").input_ids)
    tokens = httpx.post(f"{custom_server.url}/tokenize", json={"messages": messages}).json()
    assert tokens["tokens"] == tokenizer("<<hi>>").input_ids
    # Completions' default max_tokens (16) is capped too.
    out = client.completions.create(model="a", prompt="hello", extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_generation_config_vllm_ignores_the_models_defaults(custom_model):
    remote = RemoteServer(custom_model[0], ["--max-model-len", "128", "--generation-config",
                                            "vllm", "--uvicorn-log-level", "warning"])
    try:
        client = remote.client(api_key="unused")
        model = client.models.list().data[0].id
        # Not capped at max_new_tokens=3: completions' own default (16), and the request's.
        out = client.completions.create(model=model, prompt="hello",
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 16
        chat = client.chat.completions.create(model=model, max_tokens=5,
                                              messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 5
        # Not greedy: OpenAI's temperature 1 samples two different completions.
        sampled = client.completions.create(model=model, prompt="hello", n=2, seed=1,
                                            max_tokens=8, extra_body={"ignore_eos": True})
        assert sampled.choices[0].text != sampled.choices[1].text
    finally:
        remote.stop()


def test_sigterm_stops_the_core_and_removes_its_socket_directory(tiny_llama):
    remote = RemoteServer(tiny_llama, ["--max-model-len", "64", "--uvicorn-log-level",
                                       "warning"])
    core = remote.core_pid()
    assert any(name.startswith("mrv2-core-") for name in os.listdir(remote.tmpdir))
    remote.stop()  # SIGTERM, as a service manager would
    assert remote.leftovers == []
    assert not os.path.exists(f"/proc/{core}")


def test_health_is_503_once_the_engine_is_dead(custom_server):
    assert httpx.get(f"{custom_server.url}/health").status_code == 200
    os.kill(custom_server.core_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(f"{custom_server.url}/health").status_code != 503:
        assert time.monotonic() < deadline, "health did not turn 503"
        time.sleep(0.1)
    error = httpx.get(f"{custom_server.url}/health").json()["error"]
    assert error["code"] == "engine_dead" and "died" in error["message"]
    client = custom_server.client(api_key="unused")
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="a", prompt="hello")
    assert info.value.status_code == 503
    # The API process lives on: its own metrics still answer and parse.
    assert "vllm:prompt_tokens_total" in custom_server.metrics()


def test_a_busy_port_fails_before_the_model_loads(tiny_llama, monkeypatch, capsys):
    """As vLLM: the socket is bound first, so a second server on a taken port says so at once
    instead of after loading the model."""
    import socket

    from mrv2.engine.async_llm import AsyncLLM
    from mrv2.entrypoints.cli import main

    def must_not_load(*args, **kwargs):
        raise AssertionError("the engine was built before the port was bound")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", must_not_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", str(tiny_llama), "--host", "127.0.0.1", "--port", str(port)])
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_client_gone_before_its_body_is_read_is_a_499() -> None:
    """uvicorn answers `receive()` with a disconnect once the client has left, even when its
    body had arrived: parse_body turns Starlette's ClientDisconnect into the 499 of a dropped
    request instead of an exception that the server logs as its own error."""
    import asyncio

    from starlette.requests import Request

    from mrv2.entrypoints.openai.api_server import parse_body
    from mrv2.entrypoints.openai.errors import OpenAIError
    from mrv2.entrypoints.openai.protocol import CompletionRequest

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(parse_body(request, CompletionRequest))
    assert raised.value.status == 499


def test_a_body_cut_short_logs_no_server_error(server):
    """A client that sends half its body and leaves: the server logs no exception and goes on
    answering."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(server.url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {address.hostname}\r\n"
            f"Authorization: Bearer {server.headers()['Authorization'].split()[1]}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"model": "tiny", "prompt": "he')
        time.sleep(0.2)
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "Exception in ASGI" not in server.log_text()
