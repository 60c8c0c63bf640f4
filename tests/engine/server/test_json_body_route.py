"""JsonBodyRoute answers exactly as FastAPI's own handler: the same endpoint and request body
model served twice, by a plain APIRoute and by a JsonBodyRoute, get the same bodies (a table of
edge cases and hypothesis-made documents); the fast path is taken for valid JSON bodies."""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

import hypothesis.strategies as st
import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from pagedinfer.engine.server.http_server import BodyLimitMiddleware
from pagedinfer.engine.server.json_body_route import JsonBodyRoute, json_response
from pagedinfer.engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.timeout(60)
MAX_BYTES = 20_000


class _Completion(CompletionRequest):
    num_fast: ClassVar[int] = 0

    @classmethod
    def model_validate_json(cls, *args: Any, **kwargs: Any) -> Any:
        model = super().model_validate_json(*args, **kwargs)
        _Completion.num_fast += 1  # reached only when the one-pass validation succeeded
        return model


async def _completion(body: _Completion, request: Request) -> Any:
    return json_response({"repr": repr(body), "path": request.url.path})


async def _chat(body: ChatCompletionRequest, request: Request) -> Any:
    return json_response({"repr": repr(body)})


async def _with_query(body: CompletionRequest, request: Request, q: int) -> Any:
    return json_response({"repr": repr(body), "q": q})


def _client() -> TestClient:
    app = FastAPI()
    for prefix, route_class in (("/fastapi", APIRoute), ("/fast", JsonBodyRoute)):
        router = APIRouter()  # included, as the server's OpenAI routes are
        for path, endpoint in (("completions", _completion), ("chat", _chat), ("query", _with_query)):
            router.add_api_route(
                f"{prefix}/{path}", endpoint, methods=["POST"], route_class_override=route_class
            )
        app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BYTES)
    return TestClient(app, raise_server_exceptions=False)  # FastAPI 500s on some bodies: both must


CLIENT = _client()


def _both(path: str, content: bytes, content_type: str | None) -> tuple[tuple, tuple]:
    headers = {"content-type": content_type} if content_type else {}
    answers = []
    for prefix in ("/fastapi", "/fast"):
        r = CLIENT.post(f"{prefix}{path}", content=content, headers=headers)
        answers.append((r.status_code, r.headers.get("content-type"), r.text.replace(prefix, "")))
    return answers[0], answers[1]


JSON = "application/json"
CONTENT_TYPES = [
    JSON,
    "application/json; charset=utf-8",
    None,
    "text/plain",
    "application/x+json",
    "Application/JSON",
]
BODIES = [
    b"",
    b"{",
    b'{"prompt": "hi",',
    b"[1, 2]",
    b"null",
    b"{}",
    b'{"prompt": "hi"}',
    b'{"prompt": [1, 2.0, "3"], "stream": "true", "n": "2"}',
    b'{"prompt": ["a"], "stop": "x", "stream_options": {"include_usage": 1}, "unknown": [1, {"a": 2}]}',
    b'{"prompt": "x", "prompt": [5]}',  # duplicate key: the last wins in both parsers
    b'{"prompt": "x", "n": 1.5}',
    b'{"prompt": "x", "temperature": NaN, "top_p": Infinity, "min_p": 1e400}',
    b'{"prompt": "x", "seed": 100000000000000000000000000000}',
    b'{"prompt": "x", "seed": 1' + b"1" * 5000 + b"}",  # past Python's int digit limit
    b'{"prompt": "x", "u": ' + b"[" * 300 + b"]" * 300 + b"}",  # deeper than pydantic-core parses
    b'{"prompt": "x", "u": ' + b"[" * 3000 + b"]" * 3000 + b"}",  # deeper than json.loads parses
    b'{"prompt": "a\\ud800b"}',  # lone surrogate escape
    b'{"prompt": "\xed\xa0\x80"}',  # an encoded surrogate
    b'{"prompt": "\xff"}',  # not UTF-8
    b'{"prompt": "a\nb"}',  # raw control character
    b'\xef\xbb\xbf{"prompt": "bom"}',
    '{"prompt": "utf-16"}'.encode("utf-16"),
    b'{"prompt": "x"} trailing',
    b'{"prompt": "x", "request_id": "' + b"r" * 129 + b'"}',
    b'{"prompt": {"a": 1}}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "logprobs": "yes"}',
    b'{"messages": [{"role": "user", "content": ["hi"]}]}',
    b'{"messages": [{"role": "user"}], "top_logprobs": 2}',
    b"x" * (MAX_BYTES + 1),  # over the size limit (declared by Content-Length)
]


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
@pytest.mark.parametrize("path", ["/completions", "/chat"])
def test_fast_route_answers_as_fastapi_does(path: str, content_type: str | None) -> None:
    for content in BODIES:
        reference, fast = _both(path, content, content_type)
        assert fast == reference, content[:80]


def test_fast_path_taken_for_valid_json_only() -> None:
    before = _Completion.num_fast
    assert CLIENT.post("/fast/completions", json={"prompt": [1, 2]}).status_code == 200
    assert _Completion.num_fast == before + 1
    for content_type in (None, "text/plain", "application/x+json"):  # FastAPI decides these
        CLIENT.post(
            "/fast/completions", content=b'{"prompt": "x"}', headers={"content-type": content_type or ""}
        )
    CLIENT.post("/fast/completions", content=b'{"n": 1}', headers={"content-type": JSON})
    assert _Completion.num_fast == before + 1


def test_body_over_the_limit_while_streamed_answers_as_fastapi_does() -> None:
    def chunks():  # no Content-Length: the limit trips while the body is read
        for _ in range(4):
            yield b'{"prompt": "' + b"a" * (MAX_BYTES // 2) + b'"}'

    answers = [
        CLIENT.post(f"{prefix}/completions", content=chunks(), headers={"content-type": JSON})
        for prefix in ("/fastapi", "/fast")
    ]
    assert answers[0].status_code >= 400
    assert (answers[1].status_code, answers[1].text) == (answers[0].status_code, answers[0].text)


async def _asgi_post_then_disconnect(path: str) -> list[dict]:
    messages = [
        {"type": "http.request", "body": b'{"prompt": ', "more_body": True},
        {"type": "http.disconnect"},
    ]
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", JSON.encode())],
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await CLIENT.app(scope, receive, send)
    return sent


async def test_client_gone_while_body_streams_answers_as_fastapi_does() -> None:
    reference = await _asgi_post_then_disconnect("/fastapi/completions")
    fast = await _asgi_post_then_disconnect("/fast/completions")
    assert reference[0]["status"] == 400 and fast == reference


def test_other_parameters_keep_fastapi_handler() -> None:
    missing = CLIENT.post("/fast/query", json={"prompt": "x"})
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["query", "q"]
    assert CLIENT.post("/fast/query?q=3", json={"prompt": "x"}).json()["q"] == 3


async def _dict(request: Request) -> Any:
    return {"f": [0.1, 1e-7, 2.5e300, -math.inf, math.nan], "s": 'é\u2028"x', "n": None, "i": 2**70}


def test_json_response_has_fastapi_bytes() -> None:
    app = FastAPI()
    app.add_api_route("/plain", _dict)
    expected = TestClient(app).get("/plain")
    payload = json.loads(expected.text)  # -inf and nan: null in both
    ours = json_response(
        {"f": [0.1, 1e-7, 2.5e300, -math.inf, math.nan], "s": 'é\u2028"x', "n": None, "i": 2**70}
    )
    assert ours.body == expected.content and payload["f"][3] is None
    assert ours.headers["content-type"] == expected.headers["content-type"]


FIELDS = ["prompt", "messages", "n", "stream", "stop", "max_tokens", "temperature", "logprobs", "seed", "x"]
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["role", "content", "type", "text"]), inner, max_size=3)
    ),
    max_leaves=8,
)
DOCUMENTS = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5).map(
    lambda d: json.dumps(d).encode()  # NaN and Infinity literals included
) | st.binary(max_size=40)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(content=DOCUMENTS, path=st.sampled_from(["/completions", "/chat"]))
def test_fast_route_answers_as_fastapi_does_for_made_up_documents(content: bytes, path: str) -> None:
    reference, fast = _both(path, content, JSON)
    assert fast == reference
