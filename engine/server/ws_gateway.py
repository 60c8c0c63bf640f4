"""WebSocket gateway at /v1/ws: several generations per connection, multiplexed by id.

Client -> server (JSON text frames):
  {"type": "auth", "api_key": "..."}                 first, when a key is required and no header was sent
  {"type": "generate", "id": "g1", "prompt": "..." | "messages": [...] | "prompt_token_ids": [...],
   "max_tokens": 8, "temperature": 0, ...}           the same parameters as /v1/completions
  {"type": "cancel", "id": "g1"}
  {"type": "ping"}
Server -> client:
  {"type": "hello", "model": ..., "max_model_len": ...}   once the connection is accepted (and authenticated)
  {"type": "delta", "id": "g1", "deltas": [{"index", "text", "token_ids", "finish_reason"}]}
                                                      (+ "logprobs": [{"token", "logprob", "bytes",
                                                      "top_logprobs"}] per token, when asked for)
  {"type": "done", "id": "g1", "finish_reasons": [...], "usage": {...}, "timing": {...}}
  {"type": "cancelled", "id": "g1"}
  {"type": "error", "id": "g1" | null, "error": {"message", "type", "code"}}
  {"type": "pong"}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Literal
from urllib.parse import urlsplit

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import Field, ValidationError

from pagedinfer.engine.config import ServerConfig
from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.server.auth import ApiKeyAuth
from pagedinfer.engine.server.errors import ClassifiedError, ErrorKind, classify
from pagedinfer.engine.server.generation import (
    GenerationRequest,
    GenerationService,
    PromptInput,
    finish_reason_value,
)
from pagedinfer.engine.server.openai_api import timing_dict, usage_dict
from pagedinfer.engine.server.openai_protocol import DEFAULT_MAX_TOKENS, ChatMessageIn, SamplingFields
from pagedinfer.engine.server.request_fields import check_fields
from pagedinfer.engine.server.sse_render import chat_logprobs

logger = logging.getLogger("pagedinfer.server")
MAX_GENERATIONS_PER_CONNECTION = 64
WS_POLICY_VIOLATION = 1008


class WsGenerate(SamplingFields):
    type: Literal["generate"]
    id: str = Field(min_length=1, max_length=128)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessageIn] | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    logprobs: int | None = None

    def to_generation(self) -> GenerationRequest:
        messages = None
        if self.messages is not None:
            messages = tuple(m.to_message() for m in self.messages)
        token_ids = tuple(self.prompt_token_ids) if self.prompt_token_ids is not None else None
        prompt = PromptInput(text=self.prompt, token_ids=token_ids, messages=messages)
        params = self._sampling(self.max_tokens, self.logprobs)
        return GenerationRequest(prompt, params, self.priority, None, self.model)


def _error_msg(err: ClassifiedError, gen_id: str | None) -> dict[str, Any]:
    return {
        "type": "error",
        "id": gen_id,
        "error": {"message": err.message, "type": err.kind.value, "code": err.openai_code},
    }


class _Connection:
    """One socket: a send lock (frames from many generations interleave) and its live generations."""

    def __init__(
        self, ws: WebSocket, service: GenerationService, max_bytes: int, allow_unknown_fields: bool = False
    ) -> None:
        self.ws = ws
        self.service = service
        self.max_bytes = max_bytes
        self.allow_unknown_fields = allow_unknown_fields
        self.lock = asyncio.Lock()
        self.tasks: dict[str, asyncio.Task] = {}

    async def send(self, payload: dict[str, Any]) -> None:
        async with self.lock:
            await self.ws.send_text(json.dumps(payload, separators=(",", ":")))

    async def error(self, kind: ErrorKind, message: str, gen_id: str | None = None) -> None:
        await self.send(_error_msg(ClassifiedError(kind, message), gen_id))

    def parse(self, text: str | None) -> dict[str, Any] | None:
        if text is None or len(text.encode()) > self.max_bytes:
            return None
        value = json.loads(text)
        return value if isinstance(value, dict) else None

    async def handle(self, raw: dict[str, Any]) -> None:
        kind, gen_id = raw.get("type"), raw.get("id")
        gen_id = gen_id if isinstance(gen_id, str) else None
        if kind == "generate":
            await self.start(raw, gen_id)
        elif kind == "cancel":
            task = self.tasks.get(gen_id or "")
            if task is None:
                await self.error(ErrorKind.NOT_FOUND, f"no running generation with id {gen_id!r}", gen_id)
            else:
                task.cancel()
        elif kind == "ping":
            await self.send({"type": "pong"})
        elif kind == "auth":
            await self.send({"type": "auth_ok"})  # already authenticated
        else:
            message = f"unknown message type {kind!r}; expected generate, cancel, ping or auth"
            await self.error(ErrorKind.INVALID, message, gen_id)

    async def start(self, raw: dict[str, Any], gen_id: str | None) -> None:
        try:
            request = WsGenerate.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "message"
            await self.error(ErrorKind.INVALID, f"{where}: {first['msg']}", gen_id)
            return
        try:
            check_fields(request, self.allow_unknown_fields)
        except InvalidRequestError as e:
            await self.error(ErrorKind.INVALID, str(e), gen_id)
            return
        if request.id in self.tasks:
            await self.error(
                ErrorKind.INVALID, f"generation id {request.id!r} is already running", request.id
            )
            return
        if len(self.tasks) >= MAX_GENERATIONS_PER_CONNECTION:
            message = f"at most {MAX_GENERATIONS_PER_CONNECTION} concurrent generations per connection"
            await self.error(ErrorKind.OVERLOADED, message, request.id)
            return
        task = asyncio.get_running_loop().create_task(self.run(request))
        self.tasks[request.id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request.id, None))

    async def run(self, request: WsGenerate) -> None:
        gen_id, stream = request.id, None
        try:
            stream = await self.service.open(request.to_generation())
            finish: dict[int, str] = {}
            async for out in stream:
                deltas = []
                for d in out.deltas:
                    fr = finish_reason_value(d.finish_reason) if d.finish_reason is not None else None
                    if fr is not None:
                        finish[d.index] = fr
                    delta = {"index": d.index, "text": d.text, "token_ids": d.token_ids, "finish_reason": fr}
                    if d.error is not None:  # finish_reason "error": the engine's message
                        delta["error"] = d.error
                    if d.logprobs is not None:  # (the chat API's per-token entries)
                        delta["logprobs"] = chat_logprobs(d.logprobs)["content"]
                    deltas.append(delta)
                await self.send({"type": "delta", "id": gen_id, "deltas": deltas})
                if out.finished:
                    reasons = [finish[i] for i in sorted(finish)]
                    await self.send(
                        {
                            "type": "done",
                            "id": gen_id,
                            "finish_reasons": reasons,
                            "usage": usage_dict(out.usage),
                            "timing": timing_dict(out.timing),
                        }
                    )
        except asyncio.CancelledError:
            await self._send_quietly({"type": "cancelled", "id": gen_id})
            raise
        except Exception as e:  # every failure goes back on the generation's id
            await self._send_quietly(_error_msg(classify(e), gen_id))
        finally:
            if stream is not None:
                await stream.aclose()

    async def _send_quietly(self, payload: dict[str, Any]) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the socket is gone
            await self.send(payload)

    def cancel_all(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()


class WebSocketGateway:
    def __init__(self, service: GenerationService, config: ServerConfig, auth: ApiKeyAuth) -> None:
        self.service = service
        self.config = config
        self.auth = auth
        self.router = APIRouter()
        self.router.add_api_websocket_route("/v1/ws", self.endpoint)

    def origin_allowed(self, origin: str | None, host: str | None) -> bool:
        """Non-browser clients send no Origin; the demo page (same origin) is always allowed."""
        allowed = self.config.allowed_origins
        if origin is None or "*" in allowed or origin in allowed:
            return True
        return host is not None and urlsplit(origin).netloc == host

    async def endpoint(self, ws: WebSocket) -> None:
        if not self.origin_allowed(ws.headers.get("origin"), ws.headers.get("host")):
            await ws.close(code=WS_POLICY_VIOLATION, reason="origin not allowed")
            return
        await ws.accept()
        conn = _Connection(
            ws, self.service, self.config.max_ws_message_bytes, self.config.allow_unknown_fields
        )
        try:
            if not await self._authenticate(conn):
                return
            engine = self.service.handle.engine
            max_len = int(engine.max_model_len) if engine is not None else None
            await conn.send(
                {"type": "hello", "model": self.service.served_model_name, "max_model_len": max_len}
            )
            await self._loop(conn)
        except WebSocketDisconnect:
            pass
        finally:
            conn.cancel_all()

    async def _authenticate(self, conn: _Connection) -> bool:
        if self.auth.check_header(conn.ws.headers.get("authorization")):
            return True
        try:
            first = conn.parse(await conn.ws.receive_text())
        except (json.JSONDecodeError, KeyError):
            first = None
        if first and first.get("type") == "auth" and self.auth.check_token(str(first.get("api_key") or "")):
            return True
        await conn.error(
            ErrorKind.UNAUTHENTICATED,
            'missing or invalid API key: send {"type": "auth", "api_key": ...} first',
        )
        await conn.ws.close(code=WS_POLICY_VIOLATION, reason="unauthenticated")
        return False

    async def _loop(self, conn: _Connection) -> None:
        while True:
            message = await conn.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None and message.get("bytes") is not None:
                text = message["bytes"].decode("utf-8", errors="replace")
            try:
                raw = conn.parse(text)
            except json.JSONDecodeError as e:
                await conn.error(ErrorKind.INVALID, f"malformed JSON: {e}")
                continue
            if raw is None:
                too_big = text is not None and len(text.encode()) > conn.max_bytes
                message_text = (
                    f"message exceeds {conn.max_bytes} bytes"
                    if too_big
                    else "a message must be a JSON object"
                )
                await conn.error(ErrorKind.TOO_LARGE if too_big else ErrorKind.INVALID, message_text)
                continue
            await conn.handle(raw)
