"""The front end: what runs in the user's process. `LLMEngine` / `AsyncLLM` turn prompts into
core requests (input_processor.py) and core outputs into `RequestOutput`s (output_processor.py,
detokenizer.py, stop_checker.py, request_logprobs.py), and reach the engine core (mrv2/core/)
through a client (client.py, async_client.py)."""
