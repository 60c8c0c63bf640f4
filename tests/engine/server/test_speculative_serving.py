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
ACCEPTED = "pagedinfer_spec_decode_accepted_tokens_total"


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def _counter(server, name: str) -> float:
    text = httpx.get(f"{server.http}/metrics", timeout=10).text
    return sum(
        s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
    )


def _completion(client, model, **extra):
    return client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=40,
        temperature=extra.pop("temperature", 0.0),
        seed=extra.pop("seed", None),
        extra_body={"ignore_eos": True, **extra},
    )


def _complete(client, model, **extra) -> str:
    return _completion(client, model, **extra).choices[0].text


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
def test_speculation_per_request_through_the_openai_sdk(client, model, server, sampling) -> None:
    before, accepted_before = _counter(server, DRAFTS), _counter(server, ACCEPTED)
    fast = _completion(client, model, **sampling)
    drafted, accepted = _counter(server, DRAFTS), _counter(server, ACCEPTED)
    assert drafted > before  # this request speculated
    # its usage has its own drafts (the requests run one at a time): OpenAI's predicted-output fields
    details = fast.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == accepted - accepted_before > 0, fast.usage
    assert details.rejected_prediction_tokens == (drafted - before) - (accepted - accepted_before)
    plain = _completion(client, model, use_speculation=False, **sampling)
    assert _counter(server, DRAFTS) == drafted  # that one did not
    assert plain.usage.completion_tokens_details is None
    assert fast.choices[0].text == plain.choices[0].text
    server.wait_idle()


def test_speculation_per_request_through_grpc(client, model, stub, server) -> None:
    def generate(**sampling) -> tuple[str, pb.Usage]:
        params = pb.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **sampling)
        responses = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=params), timeout=120))
        return "".join(d.text for r in responses for d in r.deltas), responses[-1].usage

    before, accepted_before = _counter(server, DRAFTS), _counter(server, ACCEPTED)
    plain, plain_usage = generate(use_speculation=False)
    assert _counter(server, DRAFTS) == before and plain_usage.draft_tokens == 0
    fast, usage = generate()
    assert usage.draft_tokens == _counter(server, DRAFTS) - before > 0
    assert usage.accepted_draft_tokens == _counter(server, ACCEPTED) - accepted_before
    assert fast == plain == _complete(client, model)
    server.wait_idle()


async def test_speculation_per_request_through_the_websocket(client, model, server) -> None:
    async def generate(ws, gen_id: str, **extra) -> tuple[str, dict]:
        msg = {"type": "generate", "id": gen_id, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
        await ws.send(json.dumps({**msg, "ignore_eos": True, **extra}))
        text = ""
        while True:
            reply = json.loads(await ws.recv())
            if reply["type"] == "delta":
                text += "".join(d["text"] for d in reply["deltas"])
            else:
                assert reply["type"] == "done", reply
                return text, reply["usage"]

    async with websockets.connect(server.ws) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        before = _counter(server, DRAFTS)
        plain, plain_usage = await generate(ws, "plain", use_speculation=False)
        assert _counter(server, DRAFTS) == before and "completion_tokens_details" not in plain_usage
        fast, usage = await generate(ws, "fast")
        details = usage["completion_tokens_details"]
        drafted = details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
        assert drafted == _counter(server, DRAFTS) - before > 0
    assert fast == plain == _complete(client, model)
    server.wait_idle()


def test_a_bad_use_speculation_is_a_400(server, model) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "use_speculation": "sometimes"}
    r = httpx.post(f"{server.http}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "use_speculation" in r.json()["error"]["message"]


def test_acceptance_per_draft_position_in_the_exposition(client, model, server) -> None:
    """Per-position counters add up to the totals; a draft is accepted only after every earlier
    one, so neither series grows with the position; K = 3 positions."""
    _complete(client, model)
    server.wait_idle()
    text = httpx.get(f"{server.http}/metrics", timeout=10).text
    by_position: dict[str, dict[int, float]] = {"draft": {}, "accepted": {}}
    totals = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for kind in by_position:
                if s.name == f"pagedinfer_spec_decode_{kind}_tokens_per_position_total":
                    by_position[kind][int(s.labels["position"])] = s.value
                elif s.name == f"pagedinfer_spec_decode_{kind}_tokens_total":
                    totals[kind] = s.value
    assert sorted(by_position["draft"]) == [0, 1, 2], by_position
    for kind, series in by_position.items():
        assert sum(series.values()) == totals[kind] > 0, (kind, series, totals)
        values = [series[i] for i in sorted(series)]
        assert values == sorted(values, reverse=True), (kind, values)
    assert all(by_position["accepted"][i] <= by_position["draft"][i] for i in range(3))
