"""Honest by construction: every request field is read, or listed (request_fields.py), or refused.

The walk: each field the request models declare (HTTP, WebSocket) and each field of the gRPC
request messages must be read by the code that builds the engine request; the lists must not
name a declared field. Then, against live servers: unknown, not-yet-implemented and unsupported
fields are refused with a 400 (gRPC INVALID_ARGUMENT, a WebSocket error) naming the field;
fields without effect are accepted; --allow-unknown-fields accepts unknown ones and logs them.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import websockets
from pydantic import BaseModel

from pagedinfer.engine.server import request_fields
from pagedinfer.engine.server.openai_protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    ContentPart,
    StreamOptions,
)
from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.tokenize_api import DetokenizeRequest, TokenizeRequest
from pagedinfer.engine.server.ws_gateway import WsGenerate

SERVER_MODEL = "tiny"  # protocol behaviour, not text quality
SERVER_DIR = Path(request_fields.__file__).parent
HTTP_MODELS = [
    CompletionRequest,
    ChatCompletionRequest,
    ChatMessageIn,
    ContentPart,
    StreamOptions,
    WsGenerate,
    TokenizeRequest,
    DetokenizeRequest,
]
HTTP_READERS = sorted(p.name for p in SERVER_DIR.glob("*.py"))  # every server module
# The receivers through which the readers read request fields (a model's own methods: self).
RECEIVERS = {"self", "body", "request", "m"}
GRPC_MESSAGES = [
    pb.GenerateRequest,
    pb.SamplingParams,
    pb.ChatMessages,
    pb.ChatMessage,
    pb.TokenIds,
    pb.TokenizeRequest,
    pb.DetokenizeRequest,
    pb.GetModelInfoRequest,
]
LISTED = (
    request_fields.NO_EFFECT_FIELDS
    | request_fields.REFUSED_UNTIL_IMPLEMENTED
    | set(request_fields.UNSUPPORTED_FIELDS)
)


def reads(files: list[str]) -> tuple[set[str], set[str]]:
    """(attribute names read as `receiver.name`, string constants) in the given server modules."""
    attrs: set[str] = set()
    strings: set[str] = set()
    for name in files:
        for node in ast.walk(ast.parse((SERVER_DIR / name).read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in RECEIVERS
            ):
                attrs.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return attrs, strings


def unread_fields(models: list[type[BaseModel]], attrs: set[str]) -> list[str]:
    return [f"{m.__name__}.{f}" for m in models for f in m.model_fields if f not in attrs]


def test_every_declared_http_field_is_read() -> None:
    attrs, _ = reads(HTTP_READERS)
    assert unread_fields(HTTP_MODELS, attrs) == []


def test_the_walk_finds_a_field_nobody_reads() -> None:
    class WithOrphan(BaseModel):
        prompt: str
        orphan_field_nobody_reads: int = 0

    attrs, _ = reads(HTTP_READERS)
    assert unread_fields([WithOrphan], attrs) == ["WithOrphan.orphan_field_nobody_reads"]


def test_every_grpc_request_field_is_read() -> None:
    attrs, strings = reads(["grpc_server.py"])
    attrs |= {
        n.attr
        for n in ast.walk(ast.parse((SERVER_DIR / "grpc_server.py").read_text()))
        if isinstance(n, ast.Attribute)
    }
    unread = [
        f"{m.DESCRIPTOR.name}.{f.name}"
        for m in GRPC_MESSAGES
        for f in m.DESCRIPTOR.fields
        if f.name not in attrs and f.name not in strings
    ]
    assert unread == []


def test_lists_are_disjoint_and_name_no_declared_field() -> None:
    """A field that gets implemented is declared on the models and leaves its list."""
    no_effect, later = request_fields.NO_EFFECT_FIELDS, request_fields.REFUSED_UNTIL_IMPLEMENTED
    unsupported = set(request_fields.UNSUPPORTED_FIELDS)
    assert not (no_effect & later) and not (no_effect & unsupported) and not (later & unsupported)
    declared = {f for m in HTTP_MODELS for f in m.model_fields}
    declared |= {f.name for m in GRPC_MESSAGES for f in m.DESCRIPTOR.fields}
    assert declared & LISTED == set()


def _bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    return err.value.body


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"bogus_field": 1}, "bogus_field", "unknown field"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported yet"),  # (tools: test_tool_calls.py)
        ({"function_call": "auto"}, "function_call", "not supported yet"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "not supported"),
        (
            {"stream_options": {"include_usage": True, "extra_knob": 1}},
            "stream_options.extra_knob",
            "unknown",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "function_call": {"name": "f"}}]},
            "messages[0].function_call",
            "not supported yet",
        ),
    ],
)
def test_chat_refuses_fields_by_name(client, model, extra, param, words) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    messages = body.pop("messages")
    error = _bad_request(
        lambda: client.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body=body)
    )
    assert error["param"] == param and param in error["message"] and words in error["message"]


def test_completions_refuse_suffix_and_accept_fields_without_effect(client, model) -> None:
    error = _bad_request(
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=2, suffix="x")
    )
    assert error["param"] == "suffix" and "suffix" in error["message"]
    tools = [{"type": "function", "function": {"name": "f"}}]
    error = _bad_request(
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"tools": tools})
    )
    assert error["param"] == "tools" and "/v1/chat/completions" in error["message"]
    out = client.completions.create(
        model=model,
        prompt="hi",
        max_tokens=2,
        user="u-1",
        extra_body={"metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
    )
    assert out.usage.completion_tokens == 2


async def test_websocket_refuses_an_unknown_field(server) -> None:
    async with websockets.connect(server.ws) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        await ws.send(
            json.dumps({"type": "generate", "id": "g", "prompt": "hi", "max_tokens": 2, "bogus": 1})
        )
        msg = json.loads(await ws.recv())
        assert (
            msg["type"] == "error" and msg["id"] == "g" and "bogus: unknown field" in msg["error"]["message"]
        )


def _with_unknown_field(request: pb.GenerateRequest) -> bytes:
    """The request's bytes plus field 99 (varint 1): what a client of a newer .proto may send."""
    return request.SerializeToString() + bytes([99 << 3 & 0x7F | 0x80, 99 >> 4, 1])


def test_grpc_refuses_an_unknown_field(server) -> None:
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
    assert pb.GenerateRequest.FromString(_with_unknown_field(request)).prompt == "hi"  # (parses: kept aside)
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = channel.unary_stream(
            "/pagedinfer.v1.InferenceService/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(call(_with_unknown_field(request), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "#99" in err.value.details()
        assert list(call(request.SerializeToString(), timeout=60))[-1].finished


def test_allow_unknown_fields_accepts_and_logs_them(server_proc_cls, tiny_model) -> None:
    proc = server_proc_cls(extra_args=("--allow-unknown-fields",), model=tiny_model).start()
    try:
        proc.wait_ready()
        body = {"prompt": "hi", "max_tokens": 2, "some_vendor_knob": 3}
        assert httpx.post(f"{proc.http}/v1/completions", json=body, timeout=60).status_code == 200
        refused = httpx.post(f"{proc.http}/v1/completions", json={**body, "suffix": "x"}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix"
        tools = [{"type": "function", "function": {"name": "f"}}]
        refused = httpx.post(f"{proc.http}/v1/completions", json={**body, "tools": tools}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    finally:
        assert proc.stop() == 0
    assert "accepted unknown request fields" in proc.log() and "some_vendor_knob" in proc.log()
