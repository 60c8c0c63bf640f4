"""Engine errors that servers translate to status codes."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (SchedulerConfig.max_waiting_requests).

    Servers map it to gRPC RESOURCE_EXHAUSTED / HTTP 429; clients should retry later.
    """


class EngineDeadError(RuntimeError):
    """The step loop stopped (shutdown or a fatal error); no new requests are accepted."""


class InvalidRequestError(ValueError):
    """A request the engine can never serve (bad parameter, prompt too long, ...).

    Servers map it to gRPC INVALID_ARGUMENT / HTTP 400 / a WebSocket error message; `param`
    names the request field at fault, where known (OpenAI's error `param`).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
