"""The OpenAI-compatible HTTP server (`mrv2 serve`): a drop-in for vLLM's server.

- cli_args.py: the `serve` flags (vLLM's names) -> EngineArgs and ServerConfig
- protocol.py: request bodies (pydantic) and their SamplingParams
- errors.py: OpenAI's error envelope; every bad input becomes a 4xx
- serving_engine.py: what completions and chat share (model check, context length, streaming)
- serving_completion.py, serving_chat.py, serving_tokenization.py: the endpoints
- logprobs.py: engine logprobs -> the legacy completions and the chat formats
- metrics.py: Prometheus metrics (`mrv2:` prefix)
- api_server.py: the FastAPI app, API-key check, uvicorn
"""
