"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (SSE or not).

Each handler first sorts the body's undeclared fields (request_fields.check_fields): a field
that is neither read nor listed as having no effect is refused with a 400 that names it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.outputs import RequestOutput, RequestTiming, Usage
from pagedinfer.engine.server.completions import CollectedChoice, PromptEcho, completion_choices
from pagedinfer.engine.server.errors import ErrorKind, classify
from pagedinfer.engine.server.generation import GenerationService, GenerationStream, PromptInput
from pagedinfer.engine.server.json_body_route import JsonBodyRoute, json_response
from pagedinfer.engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body
from pagedinfer.engine.server.request_fields import check_fields
from pagedinfer.engine.server.sse_render import (
    DONE,
    SseRenderer,
    chat_logprobs,
    timing_dict,
    usage_dict,
)
from pagedinfer.engine.server.tool_calls import ToolCalling
from pagedinfer.engine.server.tool_parsers import choose_parser
from pagedinfer.engine.server.tool_stream import ToolStreamRenderer

__all__ = ["OpenAIRoutes", "timing_dict", "usage_dict"]  # ws_gateway reuses the two dicts


@dataclass
class _Collected:
    choices: dict[int, CollectedChoice] = field(default_factory=dict)
    final: RequestOutput | None = None


async def _collect(stream: GenerationStream, request: Request) -> _Collected | None:
    """Drain a stream; None (and the engine request aborted) when the client disconnects."""
    result = _Collected()

    async def drain() -> None:
        async for out in stream:
            for delta in out.deltas:
                result.choices.setdefault(delta.index, CollectedChoice()).add(delta)
            if out.finished:
                result.final = out

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return None
        task.result()
        return result
    finally:
        if not task.done():
            task.cancel()
        await stream.aclose()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class OpenAIRoutes:
    """Builds the router; the handlers translate between OpenAI JSON and engine streams."""

    def __init__(
        self, service: GenerationService, allow_unknown_fields: bool = False, tool_call_parser: str = "auto"
    ) -> None:
        self.tool_call_parser = tool_call_parser
        self.service = service
        self.allow_unknown_fields = allow_unknown_fields
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.list_models, methods=["GET"])
        self.router.add_api_route("/v1/models/{model_id:path}", self.get_model, methods=["GET"])
        # The two per-request hot paths: one-pass body validation (json_body_route.py).
        hot = {"methods": ["POST"], "route_class_override": JsonBodyRoute}
        self.router.add_api_route("/v1/completions", self.completions, **hot)
        self.router.add_api_route("/v1/chat/completions", self.chat_completions, **hot)

    def _model_card(self) -> dict:
        engine = self.service.handle.engine
        model = {
            "id": self.service.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pagedinfer",
        }
        if engine is not None:
            model["max_model_len"] = int(engine.max_model_len)
        return model

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def get_model(self, model_id: str) -> Any:
        if model_id != self.service.served_model_name:
            message = f"The model '{model_id}' does not exist; this server serves '{self.service.served_model_name}'"
            body = error_body(message, ErrorKind.NOT_FOUND.value, code="model_not_found", param="model")
            return JSONResponse(body, status_code=404)
        return self._model_card()

    # `-> Any` although both return a Response: the OpenAPI document keeps its response schemas.
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        check_fields(body, self.allow_unknown_fields)
        generations = body.to_generations()
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            _check_streamable(body, len(generations))
            stream = await self.service.open(generations[0])
            return self._stream(stream, rid, created, "text_completion", body.include_usage)
        streams: list[GenerationStream] = []
        try:
            for generation in generations:
                streams.append(await self.service.open(generation))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        results = await asyncio.gather(*(_collect(stream, request) for stream in streams))
        if any(r is None for r in results):
            return JSONResponse({}, status_code=499)
        choices: list[dict] = []
        for i, (stream, result) in enumerate(zip(streams, results, strict=True)):
            echo = self._prompt_echo(generations[i].prompt, stream.prompt_token_ids)
            choices += completion_choices(body, i, result.choices, echo)
        usages = [r.final.usage for r in results if r.final is not None and r.final.usage is not None]
        usage = _sum_usage(usages, prompt_only=body.is_prompt_only)
        timing = results[0].final.timing if len(results) == 1 and results[0].final is not None else None
        return self._body(rid, created, "text_completion", choices, usage, timing)

    def _prompt_echo(self, prompt: PromptInput, token_ids: list[int]) -> PromptEcho | None:
        engine = self.service.handle.engine
        if engine is None or not token_ids:
            return None
        tokenizer = engine.tokenizer
        text = (
            prompt.text if prompt.text is not None else tokenizer.decode(token_ids, skip_special_tokens=False)
        )
        first = tokenizer.decode(token_ids[:1], skip_special_tokens=False)
        return PromptEcho(text, first, token_ids[0])

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        check_fields(body, self.allow_unknown_fields)
        generation = body.to_generation()
        template = getattr(self.service.handle.require_engine().tokenizer, "chat_template", None)
        calling = ToolCalling.of(body, choose_parser(template, self.tool_call_parser))
        if calling is not None:  # tools in the prompt; required / named: a grammar (tool_calls.py)
            if body.stream and body.logprobs:
                raise InvalidRequestError("logprobs with streamed tool calls are not supported")
            generation = calling.apply(generation, template)
        stream = await self.service.open(generation)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            return self._stream(stream, rid, created, "chat.completion.chunk", body.include_usage, calling)
        collected = await _collect(stream, request)
        if collected is None:
            return JSONResponse({}, status_code=499)
        choices = []
        for i, c in sorted(collected.choices.items()):
            message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if calling is not None:
                message, reason = calling.message(c.text, reason)
            choice = {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": reason,
            }
            choices.append(choice | ({"error": c.error} if c.error is not None else {}))
        final = collected.final
        usage = usage_dict(final.usage) if final is not None else None
        timing = final.timing if final is not None else None
        return self._body(rid, created, "chat.completion", choices, usage, timing)

    def _body(
        self,
        rid: str,
        created: int,
        obj: str,
        choices: list,
        usage: dict | None,
        timing: RequestTiming | None,
    ) -> Response:
        body = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.service.served_model_name,
            "choices": choices,
            "usage": usage,
            "timing": timing_dict(timing),
        }
        return json_response(body)

    def _stream(
        self,
        stream: GenerationStream,
        rid: str,
        created: int,
        obj: str,
        include_usage: bool,
        calling: ToolCalling | None = None,
    ) -> StreamingResponse:
        model = self.service.served_model_name
        renderer = SseRenderer(rid, created, model, obj, include_usage)
        if calling is not None:  # OpenAI's tool-call deltas (tool_stream.py)
            renderer = ToolStreamRenderer(rid, created, model, include_usage, calling)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return SseResponse(_sse_events(stream, renderer), media_type="text/event-stream", headers=headers)


def _check_streamable(body: CompletionRequest, num_prompts: int) -> None:
    """What a streamed completion does not do (yet): refused by name rather than ignored."""
    for name, refused in (
        ("prompt", num_prompts > 1),
        ("echo", body.echo),
        ("prompt_logprobs", body.prompt_logprobs is not None),
    ):
        if refused:
            raise InvalidRequestError(f"{name}: not supported with stream=true", param=name)


def _sum_usage(usages: list[Usage], prompt_only: bool) -> dict | None:
    """Usage of several prompts' requests together (echo with max_tokens 0: no completion)."""
    if not usages:
        return None
    total = Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=0 if prompt_only else sum(u.completion_tokens for u in usages),
        cached_prompt_tokens=sum(u.cached_prompt_tokens for u in usages),
        draft_tokens=sum(u.draft_tokens for u in usages),
        accepted_draft_tokens=sum(u.accepted_draft_tokens for u in usages),
    )
    return usage_dict(total)


class SseResponse(StreamingResponse):
    """Starlette's StreamingResponse (same headers and body) of `(bytes, is_last)` events,
    without its anyio task group per request (ASGI spec < 2.4, as uvicorn serves: a task group,
    a second task and three cancel scopes, ~100-150 us a request, bench/request_cost.py). One
    plain task waits for the client's disconnect and cancels the streaming task, which ends
    quietly: the body iterator is closed, so its engine request is aborted."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        state = {"streaming": True, "cancelled": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if state["streaming"]:  # one thread: between our awaits, so it lands in stream_response
                state["cancelled"] = True
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["cancelled"]:
                raise  # cancelled from outside (shutdown): not ours to swallow
            uncancel = getattr(task, "uncancel", None)  # Python >= 3.11
            if uncancel is not None:
                uncancel()
            return
        finally:
            state["streaming"] = False
            watcher.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        """The last event and the body's end leave in one write (one send() less per request)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        more_body = True
        async for chunk, is_last in self.body_iterator:
            more_body = not is_last
            await send({"type": "http.response.body", "body": chunk, "more_body": more_body})
        if more_body:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _sse_events(stream: GenerationStream, renderer: SseRenderer) -> AsyncIterator[tuple[bytes, bool]]:
    """The SSE body both streaming endpoints share: one body write per engine output, each
    with whether it is the last (which then carries the end of the HTTP body too)."""
    done = False
    try:
        async for out in stream:
            done = out.finished
            yield renderer.render(out).encode(), done
    except Exception as e:  # headers are sent: the error travels in the stream, OpenAI-style
        err = classify(e)
        body = error_body(err.message, err.kind.value, code=err.openai_code, param=err.param)
        yield _sse(body).encode(), False
    finally:
        await stream.aclose()
    if not done:
        yield DONE.encode(), True
