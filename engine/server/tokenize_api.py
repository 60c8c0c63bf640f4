"""vLLM's /tokenize and /detokenize (same request and response shapes).

POST /tokenize {"prompt": "..."} or {"messages": [...]} (+ add_special_tokens,
add_generation_prompt, return_token_strs) -> {"count", "max_model_len", "tokens", "token_strs"}
POST /detokenize {"tokens": [...]} -> {"prompt": "..."}
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.server.generation import GenerationService, PromptInput
from pagedinfer.engine.server.openai_protocol import ALLOW_EXTRAS, ChatMessageIn
from pagedinfer.engine.server.request_fields import check_fields


class TokenizeRequest(BaseModel):
    model_config = ALLOW_EXTRAS
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's defaults (true for a prompt, false for messages)
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False

    def prompt_input(self) -> PromptInput:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt, messages", param="prompt")
        if self.messages is not None:
            return PromptInput(messages=tuple(m.to_message() for m in self.messages))
        return PromptInput(text=self.prompt)


class DetokenizeRequest(BaseModel):
    model_config = ALLOW_EXTRAS
    model: str | None = None
    tokens: list[int]


class TokenizeRoutes:
    def __init__(self, service: GenerationService, allow_unknown_fields: bool = False) -> None:
        self.service = service
        self.allow_unknown_fields = allow_unknown_fields
        self.router = APIRouter()
        self.router.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        self.router.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def tokenize(self, body: TokenizeRequest) -> dict:
        check_fields(body, self.allow_unknown_fields)
        self.service.check_model(body.model)
        engine = self.service.handle.require_engine()
        prompt = body.prompt_input()
        add_special = body.add_special_tokens
        if prompt.messages is not None and add_special:  # the chat template places special tokens
            raise InvalidRequestError(
                "add_special_tokens: applies to a prompt, not to messages", param="add_special_tokens"
            )
        if add_special is None:
            add_special = True
        ids = self.service.prompt_token_ids(
            engine, prompt, add_special_tokens=add_special, add_generation_prompt=body.add_generation_prompt
        )
        token_strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": int(engine.max_model_len),
            "tokens": ids,
            "token_strs": token_strs,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        check_fields(body, self.allow_unknown_fields)
        self.service.check_model(body.model)
        return {"prompt": self.service.detokenize(body.tokens)}
