"""A minimal OpenAI-style streaming server for testing `mrv2 bench serve`: raw asyncio HTTP/1.1,
`GET /v1/models` and streaming `POST /v1/completions` (one SSE chunk per token, `delay_s`
apart, then a usage chunk and `[DONE]`). Runs on a background thread."""

from __future__ import annotations

import asyncio
import json
import threading


class FakeOpenAIServer:
    def __init__(self, model: str = "fake-model", delay_s: float = 0.002) -> None:
        self.model = model
        self.delay_s = delay_s
        self.requests: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = (await reader.readline()).decode()
            headers = {}
            while (line := (await reader.readline()).decode().strip()):
                key, _, value = line.partition(":")
                headers[key.lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            method, path, _ = request_line.split(" ", 2)
            if method == "GET" and path == "/v1/models":
                data = json.dumps({"object": "list", "data": [{"id": self.model}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(data)
                             + data)
            elif method == "POST" and path == "/v1/completions":
                await self._stream(json.loads(body), writer)
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()

    async def _stream(self, payload: dict, writer: asyncio.StreamWriter) -> None:
        self.requests.append(payload)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n")
        n = payload["max_tokens"]
        for i in range(n):
            await asyncio.sleep(self.delay_s)
            chunk = {"id": "cmpl-1", "object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason":
                                  "length" if i == n - 1 else None}]}
            writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await writer.drain()
        usage = {"prompt_tokens": len(payload["prompt"]), "completion_tokens": n,
                 "total_tokens": len(payload["prompt"]) + n}
        writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        writer.write(b"data: [DONE]\n\n")
