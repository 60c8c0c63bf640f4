"""Typed errors of the operator."""

from __future__ import annotations


class SpecError(ValueError):
    """The spec cannot be realised: the CR goes Degraded with `reason`, and it is not retried."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class ApiError(RuntimeError):
    """A Kubernetes API call failed; `status` is the HTTP code (0: no response)."""

    def __init__(self, status: int, message: str, *, reason: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def is_retryable(self) -> bool:
        return self.status == 0 or self.status in (409, 429) or self.status >= 500
