"""One classification of request errors, shared by the gRPC, HTTP and WebSocket layers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedinfer.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from pagedinfer.engine.server.engine_handle import NotServingError
from pagedinfer.engine.server.generation import ModelNotFoundError


class ErrorKind(str, enum.Enum):
    INVALID = "invalid_request_error"  # HTTP 400, gRPC INVALID_ARGUMENT
    NOT_FOUND = "not_found_error"  # HTTP 404, gRPC NOT_FOUND
    UNAUTHENTICATED = "authentication_error"  # HTTP 401, gRPC UNAUTHENTICATED
    OVERLOADED = "overloaded_error"  # HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED
    UNAVAILABLE = "service_unavailable_error"  # HTTP 503 + Retry-After, gRPC UNAVAILABLE
    TOO_LARGE = "request_too_large"  # HTTP 413, gRPC RESOURCE_EXHAUSTED
    INTERNAL = "internal_error"  # HTTP 500, gRPC INTERNAL


HTTP_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.INTERNAL: 500,
}


@dataclass(frozen=True)
class ClassifiedError:
    kind: ErrorKind
    message: str
    retry_after_seconds: int | None = None
    code: str | None = None  # OpenAI's machine-readable code (e.g. "model_not_found")
    param: str | None = None  # the request field at fault

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.kind]

    @property
    def openai_code(self) -> str | int:
        """The `code` of an OpenAI error body: the specific code, else the HTTP status."""
        return self.code or self.http_status


def classify(exc: BaseException) -> ClassifiedError:
    if isinstance(exc, ModelNotFoundError):  # a bad input like any other (HTTP 400), OpenAI's code
        return ClassifiedError(ErrorKind.INVALID, str(exc), code="model_not_found", param="model")
    if isinstance(exc, InvalidRequestError):
        return ClassifiedError(ErrorKind.INVALID, str(exc), param=getattr(exc, "param", None))
    if isinstance(exc, NotServingError):
        return ClassifiedError(ErrorKind.UNAVAILABLE, str(exc), exc.retry_after_seconds)
    if isinstance(exc, EngineDeadError):
        return ClassifiedError(ErrorKind.UNAVAILABLE, f"server is shutting down: {exc}", 1)
    if isinstance(exc, EngineOverloadedError):
        retry = getattr(exc, "retry_after_seconds", None) or 1
        return ClassifiedError(ErrorKind.OVERLOADED, str(exc) or "server overloaded", int(retry))
    return ClassifiedError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
