"""A real `mrv2 serve` process on 127.0.0.1 (a free port), shared by the server tests.

`RemoteServer` is `mrv2.testing.server.ServerProcess` (also used by bench/) plus the OpenAI
clients, the API key and the /metrics parser the tests use. One server serves the whole session
(startup is most of the cost); tests that break a server (killing its core) start their own.
"""

from __future__ import annotations

import httpx
import pytest

from mrv2.testing.server import ServerProcess

API_KEY = "test-key"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512
SERVER_ARGS = ["--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", "32", "--api-key", API_KEY, "--uvicorn-log-level", "warning",
               # Tool calls with tool_choice "auto"; structured outputs without free whitespace
               # (a random-weight model would spend its tokens on it). Neither touches requests
               # without tools or a constraint.
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--structured-outputs-config", '{"disable_any_whitespace": true}']


class RemoteServer(ServerProcess):
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", API_KEY)
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kwargs)

    def async_client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", API_KEY)
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60,
                                  **kwargs)

    def metrics(self) -> dict[str, float]:
        """Sample name (labels dropped; one model, one engine) -> value, parsed with
        prometheus_client."""
        from prometheus_client.parser import text_string_to_metric_families

        response = httpx.get(f"{self.url}/metrics", timeout=10)
        assert response.status_code == 200
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if set(sample.labels) <= {"model_name", "engine"}:
                    values[sample.name] = sample.value
        return values


@pytest.fixture(scope="session")
def server(tiny_llama):
    remote = RemoteServer(tiny_llama, SERVER_ARGS)
    yield remote
    remote.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()
