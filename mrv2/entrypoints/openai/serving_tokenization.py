"""`POST /tokenize` and `POST /detokenize` (vLLM's extra endpoints), and `GET /v1/models`."""

from __future__ import annotations

from typing import Any

from mrv2.entrypoints.openai.errors import BadRequest
from mrv2.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from mrv2.entrypoints.openai.serving_chat import OpenAIServingChat, with_tools
from mrv2.entrypoints.openai.serving_engine import OpenAIServing, now


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat) -> None:
        super().__init__(chat.engine, chat.config, chat.metrics, chat.default_sampling)
        self.chat = chat
        self.created = now()

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        self.check_model(request.model)
        self.check_tokenizer("tokenize")
        if (request.prompt is None) == (request.messages is None):
            raise BadRequest("give exactly one of prompt and messages", param="prompt")
        if request.messages is not None:
            ids = self.chat.render(request.messages, chat_template=request.chat_template,
                                   add_generation_prompt=request.add_generation_prompt,
                                   continue_final_message=request.continue_final_message,
                                   chat_template_kwargs=with_tools(request.chat_template_kwargs,
                                                                   request.tools),
                                   add_special_tokens=request.add_special_tokens
                                   )["prompt_token_ids"]
        else:
            add_special = True if request.add_special_tokens is None \
                else request.add_special_tokens
            ids = list(self.tokenizer(request.prompt, add_special_tokens=add_special).input_ids)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(request.model)
        self.check_tokenizer("detokenize")
        vocab = self.engine.config.model_config.vocab_size
        bad = [t for t in request.tokens if t >= vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                             param="tokens")
        return {"prompt": self.tokenizer.decode(request.tokens)}

    def models(self) -> dict[str, Any]:
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "mrv2",
                  "root": self.config.model, "parent": None, "max_model_len": self.max_model_len}
                 for name in self.config.served_model_names]
        return {"object": "list", "data": cards}
