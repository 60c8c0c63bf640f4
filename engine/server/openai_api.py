"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (SSE or not)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedinfer.engine.outputs import CompletionDelta, RequestOutput, RequestTiming, SampleLogprobs, Usage
from pagedinfer.engine.server.errors import classify
from pagedinfer.engine.server.generation import GenerationService, GenerationStream, finish_reason_value
from pagedinfer.engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body


def usage_dict(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    out = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_prompt_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_prompt_tokens}
    return out


def timing_dict(timing: RequestTiming | None) -> dict[str, float] | None:
    """Per-request timing, attached to every final response (a paged-infer extension)."""
    if timing is None:
        return None
    return {
        "queue_time_seconds": timing.queue_time,
        "time_to_first_token_seconds": timing.time_to_first_token,
        "decode_time_seconds": timing.decode_time,
        "e2e_latency_seconds": timing.e2e_latency,
        "tokens_per_second": timing.tokens_per_second,
    }


def _chat_logprobs(items: list[SampleLogprobs] | None) -> dict | None:
    if items is None:
        return None
    content = []
    for lp in items:
        top = [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in lp.top]
        s = lp.sampled
        content.append(
            {"token": s.token, "logprob": s.logprob, "bytes": list(s.token.encode()), "top_logprobs": top}
        )
    return {"content": content}


def _completion_logprobs(items: list[SampleLogprobs] | None, offset: int = 0) -> dict | None:
    if items is None:
        return None
    tokens = [lp.sampled.token for lp in items]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.sampled.logprob for lp in items],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items],
        "text_offset": offsets,
    }


@dataclass
class _Choice:
    text: str = ""
    logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = finish_reason_value(delta.finish_reason)
            self.error = delta.error


@dataclass
class _Collected:
    choices: dict[int, _Choice] = field(default_factory=dict)
    final: RequestOutput | None = None


async def _collect(stream: GenerationStream, request: Request) -> _Collected | None:
    """Drain a stream; None (and the engine request aborted) when the client disconnects."""
    result = _Collected()

    async def drain() -> None:
        async for out in stream:
            for delta in out.deltas:
                result.choices.setdefault(delta.index, _Choice()).add(delta)
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

    def __init__(self, service: GenerationService) -> None:
        self.service = service
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.list_models, methods=["GET"])
        self.router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    async def list_models(self) -> dict:
        engine = self.service.handle.engine
        model = {
            "id": self.service.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pagedinfer",
        }
        if engine is not None:
            model["max_model_len"] = int(engine.max_model_len)
        return {"object": "list", "data": [model]}

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        stream = await self.service.open(body.to_generation())
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            return self._stream_response(self._completion_chunks(stream, rid, created, body.include_usage))
        collected = await _collect(stream, request)
        if collected is None:
            return JSONResponse({}, status_code=499)
        choices = [
            {
                "index": i,
                "text": c.text,
                "logprobs": _completion_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for i, c in sorted(collected.choices.items())
        ]
        return self._final_body(collected, rid, created, "text_completion", choices)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        stream = await self.service.open(body.to_generation())
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            return self._stream_response(self._chat_chunks(stream, rid, created, body.include_usage))
        collected = await _collect(stream, request)
        if collected is None:
            return JSONResponse({}, status_code=499)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for i, c in sorted(collected.choices.items())
        ]
        return self._final_body(collected, rid, created, "chat.completion", choices)

    def _final_body(self, collected: _Collected, rid: str, created: int, obj: str, choices: list) -> dict:
        final = collected.final
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.service.served_model_name,
            "choices": choices,
            "usage": usage_dict(final.usage if final else None),
            "timing": timing_dict(final.timing if final else None),
        }

    @staticmethod
    def _stream_response(chunks: AsyncIterator[str]) -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)

    async def _completion_chunks(
        self, stream: GenerationStream, rid: str, created: int, include_usage: bool
    ) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}

        def choice(d: CompletionDelta) -> dict[str, Any]:
            lp = _completion_logprobs(d.logprobs, offsets.get(d.index, 0))
            offsets[d.index] = offsets.get(d.index, 0) + len(d.text)
            return {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": _finish(d)}

        async for chunk in self._sse_chunks(stream, rid, created, include_usage, "text_completion", choice):
            yield chunk

    async def _chat_chunks(
        self, stream: GenerationStream, rid: str, created: int, include_usage: bool
    ) -> AsyncIterator[str]:
        started: set[int] = set()

        def choice(d: CompletionDelta) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": d.text}
            if d.index not in started:
                started.add(d.index)
                delta["role"] = "assistant"
            logprobs = _chat_logprobs(d.logprobs)
            return {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": _finish(d)}

        async for chunk in self._sse_chunks(
            stream, rid, created, include_usage, "chat.completion.chunk", choice
        ):
            yield chunk

    async def _sse_chunks(
        self,
        stream: GenerationStream,
        rid: str,
        created: int,
        include_usage: bool,
        obj: str,
        choice: Callable[[CompletionDelta], dict[str, Any]],
    ) -> AsyncIterator[str]:
        """The SSE framing both streaming endpoints share; `choice` renders one delta."""
        base = {"id": rid, "object": obj, "created": created, "model": self.service.served_model_name}
        try:
            async for out in stream:
                for d in out.deltas:
                    yield _sse({**base, "choices": [choice(d)], **self._tail(out, include_usage)})
                if out.finished and include_usage:
                    usage = {"usage": usage_dict(out.usage), "timing": timing_dict(out.timing)}
                    yield _sse({**base, "choices": [], **usage})
        except Exception as e:  # headers are sent: the error travels in the stream, OpenAI-style
            err = classify(e)
            yield _sse(error_body(err.message, err.kind.value, code=err.openai_code, param=err.param))
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _tail(out: RequestOutput, include_usage: bool) -> dict:
        """The last content chunk carries timing (and usage: null when a usage chunk follows)."""
        if not out.finished:
            return {"usage": None} if include_usage else {}
        return {"timing": timing_dict(out.timing)} | ({"usage": None} if include_usage else {})


def _finish(d: CompletionDelta) -> str | None:
    return finish_reason_value(d.finish_reason) if d.finish_reason is not None else None
