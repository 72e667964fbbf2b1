"""`mrv2 chat` and `mrv2 complete`: interactive clients of a running OpenAI-compatible server
(`mrv2 serve`, vLLM or any other), the counterparts of `vllm chat` / `vllm complete`.

Same flags as vLLM: `--url` (default http://localhost:8000/v1), `--model-name` (default: the
first model of `GET /models`), `--api-key` (default $OPENAI_API_KEY, then $VLLM_API_KEY - the
key `mrv2 serve` reads - else "EMPTY"), `--system-prompt` (chat), `--max-tokens` (complete) and
`-q/--quick MESSAGE` (one request, print the answer, exit). Without `-q` they read one message
a line from stdin until EOF; `chat` keeps the conversation. Answers are streamed as they arrive.

Only the standard library (urllib + a small server-sent-events reader): `openai` and `httpx`
are not dependencies of mrv2. An error from the server (OpenAI's envelope) prints as one line
on stderr: `-q` then exits 1, the interactive loop goes on with the next line. A server that
cannot be reached is one line naming the URL, and exit 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, TextIO

DEFAULT_URL = "http://localhost:8000/v1"
# vLLM's client reads OPENAI_API_KEY; VLLM_API_KEY is what the server side reads.
API_KEY_ENVS = ("OPENAI_API_KEY", "VLLM_API_KEY")
DEFAULT_API_KEY = "EMPTY"
CLIENT_TIMEOUT_S = 600.0  # per socket read: a slow first token, not the whole answer


class ClientError(Exception):
    """A failure reported as one line (no traceback); the client cannot go on."""


class ServerError(ClientError):
    """The server answered with an error (HTTP status or an error event in a stream): the
    interactive loop reports it and reads the next line."""


def add_client_parsers(sub: argparse._SubParsersAction) -> None:
    """`chat` and `complete` on the `mrv2` sub-command parser."""
    chat = sub.add_parser("chat", help="chat with a running OpenAI-compatible server")
    _add_query_options(chat)
    chat.add_argument("--system-prompt", default=None,
                      help="system message put first in the conversation")
    chat.add_argument("-q", "--quick", metavar="MESSAGE", default=None,
                      help="send MESSAGE, print the answer and exit")
    complete = sub.add_parser("complete",
                              help="text completions from a running OpenAI-compatible server")
    _add_query_options(complete)
    complete.add_argument("--max-tokens", type=int, default=None,
                          help="most tokens to generate per completion (default: the server's)")
    complete.add_argument("-q", "--quick", metavar="PROMPT", default=None,
                          help="complete PROMPT, print the completion and exit")


def _add_query_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"base URL of the server's OpenAI API (default: {DEFAULT_URL})")
    parser.add_argument("--model-name", default=None,
                        help="model to ask (default: the first one the server lists)")
    parser.add_argument("--api-key", default=None,
                        help="API key sent as 'Authorization: Bearer KEY' (default: "
                             f"${' or $'.join(API_KEY_ENVS)})")


class OpenAIHTTPClient:
    """JSON requests to one server's `/v1` base URL; streams read as server-sent events."""

    def __init__(self, url: str, api_key: str | None = None,
                 timeout: float = CLIENT_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        if api_key is None:
            api_key = next((os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)),
                           DEFAULT_API_KEY)
        self.headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json"}
        self.timeout = timeout

    def _open(self, path: str, body: dict[str, Any] | None = None):
        if not self.url.startswith(("http://", "https://")):
            raise ClientError(f"bad --url {self.url!r}: it must start with http:// or https://")
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            raise ServerError(_error_line(error.code, error.read())) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ClientError(f"cannot reach the server at {self.url} ({reason}); is it "
                              "running? (--url sets the address)") from None
        except ValueError as error:  # no scheme, say
            raise ClientError(f"bad --url {self.url!r}: {error}") from None

    def first_model(self) -> str:
        with self._open("/models") as response:
            models = _json(response.read()).get("data") or []
        if not models:
            raise ClientError(f"the server at {self.url} lists no models")
        return models[0]["id"]

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POSTs `body` with `stream: true`; yields each event's JSON until `[DONE]`."""
        with self._open(path, {**body, "stream": True}) as response:
            events = iter_sse_events(response)
            while True:
                try:
                    data = next(events, "[DONE]")
                except (OSError, http.client.HTTPException) as error:
                    raise ClientError(f"the connection to {self.url} broke off mid-answer "
                                      f"({error or type(error).__name__})") from None
                if data == "[DONE]":
                    return
                event = _json(data.encode())
                if "error" in event:
                    raise ServerError(_error_line(None, data.encode()))
                yield event


def iter_sse_events(lines) -> Iterator[str]:
    """The `data` of each server-sent event read from `lines` (bytes lines, as an HTTP
    response gives them); several `data:` lines of one event are joined with newlines."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        raise ClientError(f"the server answered something that is not JSON: {raw[:200]!r}") \
            from None
    return value if isinstance(value, dict) else {}


def _error_line(status: int | None, raw: bytes) -> str:
    """One line from OpenAI's error envelope (or the raw body when it is not one)."""
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        message = str(error.get("message") or "").strip()
        kind = error.get("code") or error.get("type")
        message = f"({kind}) {message}" if kind else message
    else:
        message = raw.decode("utf-8", "replace").strip() or "(no body)"
    prefix = f"the server answered {status}" if status else "the server reported an error"
    return " ".join(f"{prefix}: {message}".split())[:2000]


def _print_stream(events: Iterator[dict[str, Any]], field, out: TextIO) -> str:
    """Prints each chunk's text (`field(choice)`) as it arrives; returns the whole text."""
    parts: list[str] = []
    for event in events:
        for choice in event.get("choices") or []:
            text = field(choice)
            if text:
                out.write(text)
                out.flush()
                parts.append(text)
    out.write("\n")
    out.flush()
    return "".join(parts)


def _read_line(stdin: TextIO, out: TextIO) -> str | None:
    """The next line from `stdin` after a "> " prompt; None at EOF. The terminal's own stdin
    goes through input() (line editing)."""
    if stdin is sys.stdin and out is sys.stdout:
        try:
            return input("> ")
        except EOFError:
            out.write("\n")
            return None
    out.write("> ")
    out.flush()
    line = stdin.readline()
    if not line:
        out.write("\n")
        return None
    return line.rstrip("\r\n")


def _chat_text(choice: dict[str, Any]) -> str:
    return (choice.get("delta") or {}).get("content") or ""


def _completion_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or ""


def chat_loop(client: OpenAIHTTPClient, model: str, args: argparse.Namespace, stdin: TextIO,
              out: TextIO, err: TextIO, extra_body: dict[str, Any]) -> int:
    conversation: list[dict[str, str]] = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})

    def ask(message: str) -> None:
        conversation.append({"role": "user", "content": message})
        try:
            events = client.stream("/chat/completions", {**extra_body, "model": model,
                                                         "messages": list(conversation)})
            answer = _print_stream(events, _chat_text, out)
        except BaseException:
            conversation.pop()  # an unanswered message stays out of the history
            raise
        conversation.append({"role": "assistant", "content": answer})

    if args.quick is not None:
        ask(args.quick)
        return 0
    out.write("Please enter a message for the chat model:\n")
    return _loop(ask, stdin, out, err)


def complete_loop(client: OpenAIHTTPClient, model: str, args: argparse.Namespace,
                  stdin: TextIO, out: TextIO, err: TextIO, extra_body: dict[str, Any]) -> int:
    body = dict(extra_body, model=model)
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens

    def ask(prompt: str) -> None:
        _print_stream(client.stream("/completions", {**body, "prompt": prompt}),
                      _completion_text, out)

    if args.quick is not None:
        ask(args.quick)
        return 0
    out.write("Please enter prompt to complete:\n")
    return _loop(ask, stdin, out, err)


def _loop(ask, stdin: TextIO, out: TextIO, err: TextIO) -> int:
    """Reads lines until EOF; a server error on one line is reported, then the next is read."""
    while (line := _read_line(stdin, out)) is not None:
        if not line.strip():
            continue
        try:
            ask(line)
        except ServerError as error:
            out.flush()
            err.write(f"error: {error}\n")
            err.flush()
    return 0


def run_client(args: argparse.Namespace, *, stdin: TextIO | None = None,
               stdout: TextIO | None = None, stderr: TextIO | None = None,
               extra_body: dict[str, Any] | None = None) -> int:
    """`mrv2 chat` / `mrv2 complete` with parsed `args`. `extra_body`: more request fields
    (e.g. temperature, max_tokens) for callers from Python."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    client = OpenAIHTTPClient(args.url, args.api_key)
    loop = chat_loop if args.command == "chat" else complete_loop
    try:
        model = args.model_name or client.first_model()
        out.write(f"Using model: {model}\n")
        out.flush()
        return loop(client, model, args, stdin, out, err, dict(extra_body or {}))
    except ClientError as error:
        out.flush()
        err.write(f"mrv2 {args.command}: error: {error}\n")
        return 1
    except KeyboardInterrupt:
        out.write("\n")
        return 130
