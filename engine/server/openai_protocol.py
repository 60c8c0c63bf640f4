"""Pydantic request models of the OpenAI-compatible API, and their mapping to engine types.

Field ranges are left to `SamplingParams.validate` (one source of truth); pydantic checks only
types, so every bad value gets the engine's message. Extension fields beyond OpenAI's
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority,
request_id, skip_special_tokens, prompt_logprobs) are accepted as vLLM does; `use_speculation`
(default true) turns speculative decoding off for one request on an engine that speculates.

Every declared field is read here or by the routes; fields not declared land in the models'
extras, which request_fields.check_fields accepts (no effect), refuses, or refuses as unknown.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.server.generation import ChatMessage, GenerationRequest, PromptInput
from pagedinfer.engine.server.structured_fields import StructuredOutputFields
from pagedinfer.engine.server.tool_calls import ToolMessageFields, ToolRequestFields

DEFAULT_MAX_TOKENS = 16


MAX_PROMPTS = 64  # /v1/completions: prompts in one request (a list of strings or of token lists)
# Extras are kept, not dropped: request_fields.check_fields sorts them (see its docstring).
ALLOW_EXTRAS = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    model_config = ALLOW_EXTRAS
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ALLOW_EXTRAS
    type: Literal["text"]
    text: str


class ChatMessageIn(ToolMessageFields):
    model_config = ALLOW_EXTRAS
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_message(self) -> ChatMessage:
        """OpenAI's `developer` role is the `system` role of the chat templates."""
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(
            role=role,
            content=self.text(),
            name=self.name,
            tool_calls=self.tool_call_dicts(),
            tool_call_id=self.tool_call_id,
        )

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(StructuredOutputFields):
    """Fields shared by /v1/completions and /v1/chat/completions (and the structured-output
    fields: response_format, structured_outputs, guided_*)."""

    model_config = ALLOW_EXTRAS
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
    logit_bias: dict[str, float] | None = None
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
            logit_bias=self._logit_bias(),
            n=self.n,
            max_tokens=max_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            use_speculation=self.use_speculation,
            structured_output=self.structured_output(),
            **kwargs,
        )

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's {"token id": bias} (JSON keys are strings) as {id: bias}."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob plus the top k

    def prompts(self) -> list[PromptInput]:
        """One or several prompts: a string, token ids, or a list of either."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [PromptInput(text=prompt)]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [PromptInput(token_ids=tuple(prompt))]
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts in one request", param="prompt")
        if isinstance(prompt[0], str):
            return [PromptInput(text=p) for p in prompt]
        return [PromptInput(token_ids=tuple(p)) for p in prompt]

    @property
    def is_prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) only, as OpenAI answers."""
        return self.echo and self.max_tokens == 0

    @property
    def num_candidates(self) -> int:
        """Sequences generated per prompt: best_of (the n with the highest logprob are returned)."""
        if self.best_of is None:
            return self.n
        if self.best_of < self.n:
            raise InvalidRequestError(f"best_of ({self.best_of}) must be >= n ({self.n})", param="best_of")
        if self.stream and self.best_of > self.n:
            raise InvalidRequestError("best_of > n cannot stream", param="best_of")
        return self.best_of

    def to_generations(self) -> list[GenerationRequest]:
        """One engine request per prompt."""
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        # prompt only: the engine generates one token, which the response leaves out (as vLLM)
        max_tokens = 1 if self.is_prompt_only else self.max_tokens
        params = self._sampling(max_tokens, self.logprobs)
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # echoed tokens carry their logprobs
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        n = self.num_candidates
        logprobs = params.logprobs
        if n > self.n:  # best_of ranks by the sampled tokens' logprobs
            logprobs = logprobs or 0
        params = dataclasses.replace(params, n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        return [
            GenerationRequest(
                prompt=prompt,
                sampling_params=params,
                priority=self.priority,
                request_id=self.request_id
                if i == 0
                else f"{self.request_id}-{i}"
                if self.request_id
                else None,
                model=self.model,
            )
            for i, prompt in enumerate(self.prompts())
        ]


class ChatCompletionRequest(SamplingFields, ToolRequestFields):
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
        messages = tuple(m.to_message() for m in self.messages)
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
