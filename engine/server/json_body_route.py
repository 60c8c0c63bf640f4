"""A FastAPI route whose JSON body is parsed and validated in one pass by pydantic-core.

For `async def f(body: Model, request: Request) -> Response`, FastAPI's own handler reads the
body, parses the Content-Type with `email.message`, `json.loads` it, solves every parameter
kind (path, query, header, cookie, body) through its field machinery and validates the dict in
Python mode: 40-115 us of server CPU per streamed request here (bench/NOTES.md, Round 6), paid
64 times before the last of 64 simultaneous requests starts. `JsonBodyRoute` takes the common case itself (a
JSON Content-Type and a body that validates) with `Model.model_validate_json`, and hands
everything else to FastAPI's handler, which re-reads the cached body: every error (malformed
JSON, validation, other content types, a body that failed to arrive) and the OpenAPI schema
(built from the same declaration) stay FastAPI's own. A fast-path success implies a FastAPI
success with an equal model (tests/engine/server/test_json_body_route.py checks both paths).

Dependencies are not run on the fast path: such endpoints, or ones with other parameters,
keep FastAPI's handler; a router holding these routes must be included without dependencies.
FastAPI's own OpenTelemetry spans for the body, dependencies and endpoint steps are not made
on the fast path (the server does not configure FastAPI telemetry).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.types import Message

# Header values FastAPI parses as JSON too (it also takes any application/*+json and case variants).
_JSON_CONTENT_TYPES = frozenset({"application/json", "application/json; charset=utf-8"})
_ANY = TypeAdapter(Any)

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def json_response(content: Any) -> Response:
    """`content` as FastAPI answers a returned value (pydantic's `dump_json`, the same bytes),
    for endpoints of a `JsonBodyRoute`, which return a Response."""
    return Response(_ANY.dump_json(content), media_type="application/json")


class JsonBodyRoute(APIRoute):
    """APIRoute with a one-pass JSON body path for `(body: Model, request: Request) -> Response`."""

    def get_route_handler(self) -> Handler:
        fastapi_handler = super().get_route_handler()
        names = _body_and_request_names(self)
        if names is None:
            return fastapi_handler
        body_name, request_name = names
        model: type[BaseModel] = self.dependant.body_params[0].field_info.annotation
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            if request.headers.get("content-type") not in _JSON_CONTENT_TYPES:
                return await fastapi_handler(request)
            try:
                raw = await request.body()
            except Exception as exc:  # over the size limit, client gone: FastAPI's answer
                return await fastapi_handler(_failed_body(request, exc))
            try:
                body = model.model_validate_json(raw)
            except ValidationError:  # FastAPI's handler raises its own error from the same bytes
                return await fastapi_handler(request)
            response = await endpoint(**{body_name: body, request_name: request})
            assert isinstance(response, Response), "JsonBodyRoute endpoints return a Response"
            return response

        return handler


def _failed_body(request: Request, exc: Exception) -> Request:
    """The request again for FastAPI's handler, its body read failing with the same error (the
    first read consumed what had arrived; reading on would wait for a body that never ends)."""

    async def receive() -> Message:
        raise exc

    return Request(request.scope, receive)


def _body_and_request_names(route: APIRoute) -> tuple[str, str] | None:
    """The endpoint's parameter names when it takes exactly one required, non-embedded
    pydantic-model body and the Request, and nothing else (no dependencies)."""
    d = route.dependant
    others = d.path_params or d.query_params or d.header_params or d.cookie_params or d.dependencies
    specials = (d.websocket_param_name, d.http_connection_param_name, d.response_param_name)
    if others or any(specials) or d.background_tasks_param_name or d.security_scopes_param_name:
        return None
    if len(d.body_params) != 1 or d.request_param_name is None:
        return None
    field = d.body_params[0]
    annotation = field.field_info.annotation
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    if not is_model or getattr(field.field_info, "embed", False) or not field.field_info.is_required():
        return None
    return field.name, d.request_param_name
