"""Bounded HTTP request heads: uvicorn's httptools protocol with a size and a count limit.

uvicorn's httptools protocol (the one `http="auto"` picks) has no limit on the request line and
headers: llhttp keeps a header however long it grows, and any number of them (a 1 MB header and
10,000 headers were accepted). Here the bytes that arrive before a request's head is complete
are counted, and the headers too; past either limit the connection gets a 431 with an OpenAI
error body and is closed, before the app sees the request. The request line and headers are
counted exactly as they are parsed; bytes of a head still incomplete bound the memory a slow
or endless header takes (at most the limit plus one read).
"""

from __future__ import annotations

import json
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_LINGER_SECONDS = 2.0  # a refused connection is closed this long after its 431


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a request whose head is over a limit."""


def _response_431(message: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 431}}
    ).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with `max_header_bytes` (request line and headers together) and
    `max_header_count`; `limited_http_protocol` makes a subclass with the two set."""

    max_header_bytes = 64 << 10
    max_header_count = 100

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._is_in_head = True
        self._num_head_bytes = 0  # raw bytes received while the head is incomplete
        self._num_parsed_bytes = 0  # request line and headers parsed so far
        self._is_refused = False

    def data_received(self, data: bytes) -> None:
        # uvicorn's own data_received (0.36), plus the byte count and the 431.
        if self._is_refused:
            return
        if self._is_in_head:
            self._num_head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadRefused):
                self._refuse(str(exc.__context__))
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._is_in_head and self._num_head_bytes > self.max_header_bytes:  # a head that never ends
            self._refuse(f"request headers exceed {self.max_header_bytes} bytes")

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.max_header_count:
            raise _HeadRefused(f"more than {self.max_header_count} request headers")
        self._count(len(name) + len(value) + 4)  # name: value CRLF
        super().on_header(name, value)

    def _count(self, num_bytes: int) -> None:
        self._num_parsed_bytes += num_bytes
        if self._num_parsed_bytes > self.max_header_bytes:
            raise _HeadRefused(f"request headers exceed {self.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._is_in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._is_in_head = True  # the next request on this connection starts its own count
        self._num_head_bytes = self._num_parsed_bytes = 0

    def _refuse(self, message: str) -> None:
        """Answer 431 and end the connection. Closing at once would reset it while the client
        still sends (the unread head in our socket buffer makes the kernel send RST) and the
        client would lose the answer: half-close, drop what still arrives, close a little later."""
        self._is_refused = True
        self.logger.warning("refused a request: %s", message)
        self.transport.write(_response_431(message))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_SECONDS, self.transport.close)


def limited_http_protocol(max_header_bytes: int, max_header_count: int) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for uvicorn.Config(http=...) with these limits."""
    attrs = {"max_header_bytes": max_header_bytes, "max_header_count": max_header_count}
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), attrs)
