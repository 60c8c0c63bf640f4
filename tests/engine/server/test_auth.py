"""--api-key (here through PAGEDINFER_API_KEY) on all three ingress paths; probes stay open."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
import websockets
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(server_proc_cls, tiny_model):
    proc = server_proc_cls(model=tiny_model, env={"PAGEDINFER_API_KEY": KEY}).start()
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.log()[-4000:]


def test_http_needs_the_key_but_probes_do_not(server) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.http}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.http}/v1/models").status_code == 401
    ok = httpx.post(
        f"{server.http}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    for path in ("/health", "/ready", "/startup", "/metrics", "/"):
        assert httpx.get(f"{server.http}{path}").status_code == 200, path


def test_grpc_needs_the_key_but_health_does_not(server) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=metadata, timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", f"Bearer {KEY}"),)
        assert list(stub.Generate(request, metadata=good, timeout=60))[-1].finished
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_websocket_auth_by_header_or_first_message(server) -> None:
    async with websockets.connect(server.ws) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "hi"}))
        msg = json.loads(await ws.recv())
        assert msg["type"] == "error" and msg["error"]["type"] == "authentication_error"
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            await ws.recv()
    async with websockets.connect(server.ws) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": KEY}))
        assert json.loads(await ws.recv())["type"] == "hello"
    async with websockets.connect(server.ws, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
