"""A speculating server (n-gram, the tiny random model) through its real ingress: the OpenAI SDK,
gRPC stubs, a WebSocket client and raw HTTP. Speculation shows in the Prometheus exposition (parsed); a request can
turn it off for itself (`use_speculation`: an OpenAI / WebSocket extension field, a proto field); greedy and
seeded sampled requests get the same text either way (n-gram drafts are verified by matching the
plain sampler's draws); a bad value is a 400 with a JSON body."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

SERVER_MODEL = "tiny"
SERVER_ARGS = ("--speculative-method", "ngram", "--num-speculative-tokens", "3")
PROMPT = "ab ab ab ab ab ab ab ab ab ab ab ab"  # the random model's continuation repeats: drafts match
DRAFTS = "pagedinfer_spec_decode_draft_tokens_total"


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def _counter(server, name: str) -> float:
    text = httpx.get(f"{server.http}/metrics", timeout=10).text
    return sum(
        s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
    )


def _complete(client, model, **extra) -> str:
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=40,
        temperature=extra.pop("temperature", 0.0),
        seed=extra.pop("seed", None),
        extra_body={"ignore_eos": True, **extra},
    )
    return out.choices[0].text


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
def test_speculation_per_request_through_the_openai_sdk(client, model, server, sampling) -> None:
    before = _counter(server, DRAFTS)
    fast = _complete(client, model, **sampling)
    drafted = _counter(server, DRAFTS)
    assert drafted > before  # this request speculated
    plain = _complete(client, model, use_speculation=False, **sampling)
    assert _counter(server, DRAFTS) == drafted  # that one did not
    assert fast == plain
    server.wait_idle()


def test_speculation_per_request_through_grpc(client, model, stub, server) -> None:
    def generate(**sampling) -> str:
        params = pb.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **sampling)
        responses = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=params), timeout=120)
        return "".join(d.text for r in responses for d in r.deltas)

    before = _counter(server, DRAFTS)
    plain = generate(use_speculation=False)
    assert _counter(server, DRAFTS) == before
    fast = generate()
    assert _counter(server, DRAFTS) > before
    assert fast == plain == _complete(client, model)
    server.wait_idle()


async def test_speculation_per_request_through_the_websocket(client, model, server) -> None:
    async def generate(ws, gen_id: str, **extra) -> str:
        msg = {"type": "generate", "id": gen_id, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
        await ws.send(json.dumps({**msg, "ignore_eos": True, **extra}))
        text = ""
        while True:
            reply = json.loads(await ws.recv())
            if reply["type"] == "delta":
                text += "".join(d["text"] for d in reply["deltas"])
            else:
                assert reply["type"] == "done", reply
                return text

    async with websockets.connect(server.ws) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        before = _counter(server, DRAFTS)
        plain = await generate(ws, "plain", use_speculation=False)
        assert _counter(server, DRAFTS) == before
        fast = await generate(ws, "fast")
        assert _counter(server, DRAFTS) > before
    assert fast == plain == _complete(client, model)
    server.wait_idle()


def test_a_bad_use_speculation_is_a_400(server, model) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "use_speculation": "sometimes"}
    r = httpx.post(f"{server.http}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "use_speculation" in r.json()["error"]["message"]
