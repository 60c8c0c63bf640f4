"""Pydantic request models of the OpenAI-compatible API, and their mapping to engine types.

Field ranges are left to `SamplingParams.validate` (one source of truth); pydantic checks only
types, so every bad value gets the engine's message. Extension fields beyond OpenAI's
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority,
request_id, skip_special_tokens) are accepted as vLLM does; `use_speculation` (default true)
turns speculative decoding off for one request on an engine that speculates.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedinfer.engine.sampling_params import InvalidRequestError, SamplingParams
from pagedinfer.engine.server.generation import ChatMessage, GenerationRequest, PromptInput

DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM-compatible names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    use_speculation: bool = True
    priority: int = 0
    request_id: str | None = Field(default=None, max_length=128)

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            use_speculation=self.use_speculation,
            **kwargs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False

    def to_generation(self) -> GenerationRequest:
        if self.echo:
            raise InvalidRequestError("echo is not supported")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise InvalidRequestError("a list of several prompts is not supported; send one request each")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_input = PromptInput(text=prompt)
        else:
            prompt_input = PromptInput(token_ids=tuple(prompt))  # ints already (pydantic)
        return GenerationRequest(
            prompt=prompt_input,
            sampling_params=self._sampling(self.max_tokens, self.logprobs),
            priority=self.priority,
            request_id=self.request_id,
            model=self.model,
        )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def to_generation(self) -> GenerationRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        messages = tuple(ChatMessage(role=m.role, content=m.text()) for m in self.messages)
        return GenerationRequest(
            prompt=PromptInput(messages=messages),
            sampling_params=self._sampling(max_tokens, logprobs),
            priority=self.priority,
            request_id=self.request_id,
            model=self.model,
        )


def error_body(message: str, err_type: str, code: str | int | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
