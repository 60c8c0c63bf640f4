"""Engine errors that servers translate to status codes (InvalidRequestError is in sampling_params)."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (SchedulerConfig.max_waiting_requests).

    Servers map it to gRPC RESOURCE_EXHAUSTED / HTTP 429; clients should retry later.
    """


class EngineDeadError(RuntimeError):
    """The step loop stopped (shutdown or a fatal error); no new requests are accepted."""
