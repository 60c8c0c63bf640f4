"""Optional bearer-token check shared by the HTTP, WebSocket and gRPC ingress paths."""

from __future__ import annotations

import hmac

# Paths that stay open even with an API key (probes and scraping).
OPEN_HTTP_PATHS = frozenset({"/health", "/ready", "/startup", "/metrics"})


class ApiKeyAuth:
    """`api_key=None` disables authentication."""

    def __init__(self, api_key: str | None) -> None:
        self._api_key = api_key or None

    @property
    def enabled(self) -> bool:
        return self._api_key is not None

    def check_token(self, token: str | None) -> bool:
        if self._api_key is None:
            return True
        if not token:
            return False
        return hmac.compare_digest(token.encode(), self._api_key.encode())

    def check_header(self, authorization: str | None) -> bool:
        """Accepts `Authorization: Bearer <key>` (scheme case-insensitive)."""
        if self._api_key is None:
            return True
        return self.check_token(bearer_token(authorization))

    def is_open_path(self, path: str) -> bool:
        return path in OPEN_HTTP_PATHS or path == "/" or path.startswith("/static/")


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
