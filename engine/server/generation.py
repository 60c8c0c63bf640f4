"""What every ingress path (gRPC, OpenAI HTTP, WebSocket) does with a generation request.

The protocol layers only translate: they build a `GenerationRequest`, call
`GenerationService.open`, and relay `RequestOutput`s. Errors the engine raises before
streaming (bad input, overload) surface from `open`, so HTTP can still answer 400/429
instead of a 200 stream. Leaving the stream early (client gone, cancel, deadline) aborts the
engine request, which frees its KV-cache blocks; the abort runs in its own task so that a
cancelled caller cannot skip it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.metrics import ServingMetrics
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.server.engine_handle import EngineHandle

_ROLES = ("system", "user", "assistant", "tool")


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve: a bad input (HTTP 400 with code
    "model_not_found", gRPC INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None  # OpenAI's participant name: given to the chat template as `name`
    # an assistant's tool calls ({"id", "type", "function": {"name", "arguments"}}), a tool
    # result's call id: given to the chat template as `tool_calls` / `tool_call_id`
    tool_calls: tuple[dict, ...] | None = None
    tool_call_id: str | None = None


@dataclass(frozen=True)
class PromptInput:
    """Exactly one of: text, token ids, chat messages."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    tools: tuple[dict, ...] | None = None  # chat: given to a template that takes `tools`


@dataclass(frozen=True)
class GenerationRequest:
    prompt: PromptInput
    sampling_params: SamplingParams
    priority: int = 0
    request_id: str | None = None
    model: str | None = None  # None or "": the served model


def check_unicode(request: GenerationRequest) -> None:
    """Refuse lone UTF-16 surrogates (JSON escapes such as "\\ud800", which Python's json
    accepts): they are not text, and the tokenizer or the UTF-8 reply would fail on them."""
    fields: list[tuple[str, str | None]] = [("model", request.model), ("prompt", request.prompt.text)]
    for i, message in enumerate(request.prompt.messages or ()):
        fields += [(f"messages[{i}].role", message.role), (f"messages[{i}].content", message.content)]
    fields += [(f"stop[{i}]", stop) for i, stop in enumerate(request.sampling_params.stop)]
    for name, value in fields:
        if value and not _is_unicode(value):
            raise InvalidRequestError(
                f"{name} is not valid Unicode: it holds a lone surrogate (U+D800-U+DFFF)"
            )


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _message_dict(m: ChatMessage) -> dict:
    """A message as chat templates read it (optional keys only where set)."""
    out: dict = {"role": m.role, "content": m.content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = list(m.tool_calls)
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason_value(reason: Any) -> str:
    return getattr(reason, "value", str(reason))


class GenerationStream:
    """An open engine request: iterate for `RequestOutput`s (the first one is already here).

    Its time to first token is measured here, when the first output with tokens is handed to
    the transport, from when the server opened the request: the final output's `timing` (and
    the TTFT histogram) carry that, which is what a client sees, not when the engine sampled it.
    """

    def __init__(
        self,
        service: GenerationService,
        engine: Any,
        request_id: str,
        first: RequestOutput,
        gen: Any,
        opened_at: float | None = None,
    ):
        self.request_id = request_id
        self._service = service
        self._engine = engine
        self._gen = gen
        self._pending: RequestOutput | None = first
        self._last_time = time.monotonic()
        self._finish_reasons: dict[int, str] = {}
        self._final: RequestOutput | None = None
        self._closed = False
        self.prompt_token_ids: list[int] = []  # set by GenerationService.open (echo reads it)
        self._opened_at = time.monotonic() if opened_at is None else opened_at
        self._first_token_at: float | None = None

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending is not None:
            out, self._pending = self._pending, None
        elif self._closed or self._final is not None:
            raise StopAsyncIteration
        else:
            try:
                out = await self._gen.__anext__()
            except StopAsyncIteration:
                self._finish("abort")
                raise
            now = time.monotonic()
            num_new = sum(len(d.token_ids) for d in out.deltas)
            self._service.metrics.observe_step_gap(now - self._last_time, num_new)
            self._last_time = now
        for delta in out.deltas:
            if delta.finish_reason is not None:
                self._finish_reasons[delta.index] = finish_reason_value(delta.finish_reason)
            if self._first_token_at is None and delta.token_ids:
                self._first_token_at = time.monotonic()
        if out.finished:
            if out.timing is not None and self._first_token_at is not None:
                ttft = self._first_token_at - self._opened_at
                out.timing = dataclasses.replace(out.timing, time_to_first_token=ttft)
            self._final = out
            self._finish(self._finish_reasons.get(0, "stop"))
        return out

    def _finish(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._service.metrics.observe_finished(self._final, reason)
        self._service.handle.request_finished()

    async def aclose(self) -> None:
        """Abort the engine request unless it finished; safe to call more than once."""
        if self._closed:
            return
        self._closed = True

        def done() -> None:
            self._service.metrics.observe_finished(None, "abort")
            self._service.handle.request_finished()

        self._service.spawn_abort(self._engine, self.request_id, self._gen, done)


class GenerationService:
    """Validates requests, opens engine streams, records metrics, aborts abandoned requests."""

    def __init__(self, handle: EngineHandle, metrics: ServingMetrics) -> None:
        self.handle = handle
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

    @property
    def served_model_name(self) -> str:
        return self.metrics.model

    def check_model(self, model: str | None) -> None:
        if model and model != self.served_model_name:
            raise ModelNotFoundError(
                f"The model '{model}' does not exist; this server serves '{self.served_model_name}'"
            )

    def prompt_token_ids(
        self,
        engine: Any,
        prompt: PromptInput,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Tokenize text or render chat messages with the model's template."""
        given = [x is not None for x in (prompt.text, prompt.token_ids, prompt.messages)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of: prompt text, prompt token ids, chat messages")
        if prompt.token_ids is not None:
            return self._check_token_ids(engine, prompt.token_ids)
        if prompt.messages is not None:
            return self._render_chat(engine, prompt.messages, add_generation_prompt, prompt.tools)
        assert prompt.text is not None
        if not prompt.text:
            raise InvalidRequestError("prompt must not be empty")
        return list(engine.tokenizer.encode(prompt.text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (each checked against the vocabulary)."""
        engine = self.handle.require_engine()
        if not token_ids:
            return ""
        ids = self._check_token_ids(engine, token_ids)
        return engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _check_token_ids(self, engine: Any, token_ids: Sequence[int]) -> list[int]:
        vocab_size = engine.model_config.vocab_size
        if not token_ids:
            raise InvalidRequestError("prompt token ids must not be empty")
        ids = list(map(int, token_ids))
        if min(ids) < 0 or max(ids) >= vocab_size:  # C loops; the slow scan only to name the bad id
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise InvalidRequestError(f"token id {bad} out of range [0, {vocab_size})")
        return ids

    def _render_chat(
        self,
        engine: Any,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> list[int]:
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        for m in messages:
            if m.role not in _ROLES:
                raise InvalidRequestError(
                    f"unknown message role '{m.role}' (expected one of {', '.join(_ROLES)})"
                )
        tokenizer = engine.tokenizer
        dicts = [_message_dict(m) for m in messages]
        extra = {"tools": list(tools)} if tools else {}  # (tool_calls.py: templates that take them)
        try:
            if hasattr(tokenizer, "encode_chat"):
                return list(
                    tokenizer.encode_chat(dicts, add_generation_prompt=add_generation_prompt, **extra)
                )
            rendered = tokenizer.apply_chat_template(
                dicts, add_generation_prompt=add_generation_prompt, **extra
            )
        except InvalidRequestError:
            raise
        except ValueError as e:  # the tokenizer's ChatTemplateError: a bad conversation, not a crash
            raise InvalidRequestError(str(e)) from e
        if isinstance(rendered, str):
            return list(tokenizer.encode(rendered, add_special_tokens=False))
        return list(rendered)

    def _check_length(self, engine: Any, num_prompt_tokens: int, params: SamplingParams) -> None:
        max_len = int(engine.max_model_len)
        if num_prompt_tokens >= max_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens; this model's context is {max_len} tokens "
                "(prompt plus at least one generated token must fit)"
            )
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({num_prompt_tokens} tokens) exceeds "
                f"the context length {max_len}; lower max_tokens to at most {max_len - num_prompt_tokens}"
            )

    async def open(self, request: GenerationRequest) -> GenerationStream:
        """Start a generation; raises InvalidRequestError, NotServingError or the engine's overload error."""
        opened_at = time.monotonic()
        engine = self.handle.require_engine()
        check_unicode(request)
        self.check_model(request.model)
        token_ids = self.prompt_token_ids(engine, request.prompt)
        self._check_length(engine, len(token_ids), request.sampling_params)
        request_id = request.request_id or new_request_id()
        gen = engine.generate(
            prompt_token_ids=token_ids,
            sampling_params=request.sampling_params,
            priority=request.priority,
            request_id=request_id,
        )
        self.handle.request_started()
        try:
            first = await gen.__anext__()
        except BaseException:
            # Never abort by id here: an error raised before the engine admitted the request
            # (an id already in flight among them) would end the other request of that id. The
            # engine's generator aborts what it admitted on its way out (AsyncEngine.generate's
            # finally, on an error or on a cancel thrown into it); closing it covers the rest.
            self.handle.request_finished()
            self.spawn_abort(None, request_id, gen)
            raise
        stream = GenerationStream(self, engine, request_id, first, gen, opened_at)
        stream.prompt_token_ids = token_ids
        return stream

    def spawn_abort(
        self, engine: Any, request_id: str, gen: Any, on_done: Callable[[], None] | None = None
    ) -> None:
        """Abort in a task of its own: a cancelled caller (anyio cancel scope) cannot interrupt it."""
        task = asyncio.get_running_loop().create_task(self._abort(engine, request_id, gen, on_done))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(
        self, engine: Any, request_id: str, gen: Any, on_done: Callable[[], None] | None
    ) -> None:
        try:
            if engine is not None:  # None: only close the generator
                await engine.abort(request_id)
            await gen.aclose()
        finally:
            if on_done is not None:
                on_done()

    async def wait_background(self) -> None:
        """Let pending aborts finish (used by shutdown and tests)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
