"""`mrv2 chat` / `mrv2 complete` (mrv2/entrypoints/chat_client.py) against the shared real
`mrv2 serve` (conftest.py), called in-process with their stdin / stdout / stderr captured."""

from __future__ import annotations

import io

import httpx

from mrv2.entrypoints.chat_client import OpenAIHTTPClient, ServerError, iter_sse_events, \
    run_client
from mrv2.entrypoints.cli import build_parser, main
from mrv2.testing.server import free_port

from .conftest import API_KEY, MODEL_NAME

# Greedy and a fixed length: the same answer on every run from the random-weight model.
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def _run(argv: list[str], stdin: str = "", extra_body: dict | None = None):
    out, err = io.StringIO(), io.StringIO()
    code = run_client(build_parser().parse_args(argv), stdin=io.StringIO(stdin), stdout=out,
                      stderr=err, extra_body=extra_body)
    return code, out.getvalue(), err.getvalue()


def _direct(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}/v1{path}", json={"model": MODEL_NAME, **body},
                          headers=server.headers(), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_quick_chat_prints_the_answer_of_the_first_listed_model(server):
    message = "What is the capital of France?"
    expected = _direct(server, "/chat/completions",
                       {"messages": [{"role": "user", "content": message}], **GREEDY})
    code, out, err = _run(["chat", "--url", f"{server.url}/v1", "--api-key", API_KEY,
                           "-q", message], extra_body=GREEDY)
    assert (code, err) == (0, "")
    assert expected["message"]["content"]
    assert out == f"Using model: {MODEL_NAME}\n{expected['message']['content']}\n"


def test_quick_complete_takes_max_tokens_and_the_key_from_the_environment(server,
                                                                         monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    expected = _direct(server, "/completions",
                       {"prompt": "The quick brown fox", **GREEDY, "max_tokens": 5})
    code, out, err = _run(["complete", "--url", f"{server.url}/v1/", "--model-name",
                           MODEL_NAME, "--max-tokens", "5", "-q", "The quick brown fox"],
                          extra_body={"temperature": 0, "ignore_eos": True})
    assert (code, err) == (0, "")
    assert expected["text"] and out == f"Using model: {MODEL_NAME}\n{expected['text']}\n"


def test_interactive_chat_keeps_the_conversation(server, monkeypatch):
    sent: list[dict] = []
    original = OpenAIHTTPClient.stream

    def recording(self, path, body):
        sent.append(body)
        return original(self, path, body)

    monkeypatch.setattr(OpenAIHTTPClient, "stream", recording)
    code, out, err = _run(["chat", "--url", f"{server.url}/v1", "--api-key", API_KEY,
                           "--model-name", MODEL_NAME, "--system-prompt", "Be brief."],
                          stdin="Hello there\n\nAnd then?\n", extra_body=GREEDY)
    assert (code, err) == (0, "")
    assert len(sent) == 2  # the blank line sends nothing
    assert sent[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hello there"}]
    first_answer = sent[1]["messages"][2]
    assert first_answer["role"] == "assistant" and first_answer["content"]
    assert sent[1]["messages"] == [*sent[0]["messages"], first_answer,
                                   {"role": "user", "content": "And then?"}]
    assert all(body["temperature"] == 0 and body["model"] == MODEL_NAME for body in sent)
    # Each answer streamed after its prompt; a prompt for the blank line; EOF ends the loop.
    assert out.startswith(f"Using model: {MODEL_NAME}\nPlease enter a message for the chat "
                          f"model:\n> {first_answer['content']}\n> > ")
    assert out.endswith("\n> \n")


def test_interactive_complete_reports_a_bad_line_and_goes_on(server):
    expected = _direct(server, "/completions",
                       {"prompt": "Once upon a time", **GREEDY, "max_tokens": 3})["text"]
    code, out, err = _run(["complete", "--url", f"{server.url}/v1", "--api-key", API_KEY,
                           "--max-tokens", "3"],  # a prompt over the context first: a 400
                          stdin="word " * 600 + "\nOnce upon a time\n", extra_body=GREEDY)
    assert code == 0
    assert err.count("\n") == 1 and err.startswith("error: the server answered 400: ")
    assert out == (f"Using model: {MODEL_NAME}\nPlease enter prompt to complete:\n"
                   f"> > {expected}\n> \n")


def test_bad_api_key_is_one_line_and_a_failure(server, capsys):
    code = main(["chat", "--url", f"{server.url}/v1", "--api-key", "wrong", "-q", "Hi"])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("mrv2 chat: error: the server answered 401: "
                                   "(invalid_api_key) Incorrect or missing API key")


def test_unreachable_server_names_the_url(capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    code = main(["complete", "--url", url, "--model-name", "m", "-q", "Hi"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"mrv2 complete: error: cannot reach the server at {url} (")
    assert "Traceback" not in err


def test_server_sent_events_and_an_error_event_mid_stream(monkeypatch):
    lines = [b": comment\r\n", b"data: {\"a\":\r\n", b"data: 1}\r\n", b"\r\n",
             b"event: x\n", b"data:[DONE]\n", b"\n"]
    assert list(iter_sse_events(lines)) == ['{"a":\n1}', "[DONE]"]

    body = (b'data: {"choices":[{"text":"ok"}]}\n\n'
            b'data: {"error":{"message":"engine died","type":"server_error","code":null}}\n\n'
            b"data: [DONE]\n\n")
    client = OpenAIHTTPClient("http://unused/v1", api_key="k")
    monkeypatch.setattr(client, "_open", lambda path, body_=None: io.BytesIO(body))
    events = client.stream("/completions", {})
    assert next(events) == {"choices": [{"text": "ok"}]}
    try:
        next(events)
    except ServerError as error:
        assert str(error) == "the server reported an error: (server_error) engine died"
    else:
        raise AssertionError("no ServerError")
