"""The HTTP app (one port): OpenAI API, WebSocket gateway, demo page, health probes, metrics.

Every error leaves in OpenAI's JSON shape; FastAPI's 422 for a body that fails validation
becomes 400, as OpenAI answers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedinfer.engine.config import ServerConfig
from pagedinfer.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from pagedinfer.engine.server.auth import ApiKeyAuth
from pagedinfer.engine.server.engine_handle import NotServingError
from pagedinfer.engine.server.errors import ClassifiedError, ErrorKind, classify
from pagedinfer.engine.server.generation import GenerationService
from pagedinfer.engine.server.openai_api import OpenAIRoutes
from pagedinfer.engine.server.openai_protocol import error_body
from pagedinfer.engine.server.tokenize_api import TokenizeRoutes
from pagedinfer.engine.server.ws_gateway import WebSocketGateway

logger = logging.getLogger("pagedinfer.server")
STATIC_DIR = Path(__file__).parent / "static"


class PayloadTooLargeError(Exception):
    pass


class BodyLimitMiddleware:
    """Refuses request bodies above `max_bytes`, declared (Content-Length) or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _too_large(self.max_bytes)(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise PayloadTooLargeError()
            return message

        await self.app(scope, limited_receive, send)


def _too_large(max_bytes: int) -> JSONResponse:
    return error_response(ClassifiedError(ErrorKind.TOO_LARGE, f"request body exceeds {max_bytes} bytes"))


class AuthMiddleware:
    """Bearer-token check for every HTTP path except probes, metrics and the page."""

    def __init__(self, app: ASGIApp, auth: ApiKeyAuth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.auth.enabled or self.auth.is_open_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        if self.auth.check_header(header):
            await self.app(scope, receive, send)
            return
        err = ClassifiedError(
            ErrorKind.UNAUTHENTICATED, "missing or invalid API key (Authorization: Bearer ...)"
        )
        await error_response(err)(scope, receive, send)


def error_response(err: ClassifiedError, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_seconds)} if err.retry_after_seconds else None
    body = error_body(err.message, err.kind.value, code=err.openai_code, param=param or err.param)
    return JSONResponse(body, status_code=err.http_status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    where = ".".join(loc) or "body"
    return f"{where}: {first.get('msg', 'invalid value')}", where


def _install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(ClassifiedError(ErrorKind.INVALID, message), param=param)

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: ErrorKind.NOT_FOUND, 401: ErrorKind.UNAUTHENTICATED, 413: ErrorKind.TOO_LARGE}
        kind = kinds.get(exc.status_code, ErrorKind.INVALID if exc.status_code < 500 else ErrorKind.INTERNAL)
        body = error_body(str(exc.detail), kind.value, code=exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def on_too_large(_: Request, exc: PayloadTooLargeError) -> JSONResponse:
        return _too_large(app.state.server_config.max_request_bytes)

    async def on_any(_: Request, exc: Exception) -> JSONResponse:
        err = classify(exc)
        if err.kind is ErrorKind.INTERNAL:
            logger.exception("internal error", exc_info=exc)
        return error_response(err)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(PayloadTooLargeError, on_too_large)
    # Expected errors by class (handled inside the app, not re-raised by ServerErrorMiddleware).
    for exc_type in (InvalidRequestError, NotServingError, EngineOverloadedError, EngineDeadError):
        app.add_exception_handler(exc_type, on_any)
    app.add_exception_handler(Exception, on_any)


def _add_probe_routes(app: FastAPI, service: GenerationService) -> None:
    handle, metrics = service.handle, service.metrics

    @app.get("/health", include_in_schema=False)
    async def health() -> JSONResponse:
        if handle.is_alive:
            return JSONResponse({"status": "alive"})
        return JSONResponse({"status": "dead", "error": handle.error}, status_code=503)

    @app.get("/ready", include_in_schema=False)
    async def ready() -> JSONResponse:
        body = {"ready": handle.is_ready, "state": handle.state.value}
        return JSONResponse(body, status_code=200 if handle.is_ready else 503)

    @app.get("/startup", include_in_schema=False)
    async def startup() -> JSONResponse:
        report = handle.startup_report()
        serving = report.phase == "ready"
        return JSONResponse(report.to_dict(), status_code=200 if serving else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.scrape_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/engine_stats", include_in_schema=False)
    async def engine_stats() -> dict[str, Any]:
        return {"state": handle.state.value, "num_in_flight": handle.num_in_flight, "engine": handle.stats()}


def build_app(service: GenerationService, config: ServerConfig, auth: ApiKeyAuth) -> FastAPI:
    """The whole HTTP surface of one server; `service` carries the engine handle and metrics."""
    app = FastAPI(title="paged-infer", version="1", docs_url="/docs", redoc_url=None)
    app.state.server_config = config
    _install_error_handlers(app)
    # Routes match in order: the OpenAI paths (the per-request hot path) before the probes.
    app.include_router(OpenAIRoutes(service, config.allow_unknown_fields, config.tool_call_parser).router)
    app.include_router(TokenizeRoutes(service, config.allow_unknown_fields).router)
    _add_probe_routes(app, service)
    app.include_router(WebSocketGateway(service, config, auth).router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    app.add_middleware(AuthMiddleware, auth=auth)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    return app
