"""gRPC through the generated stubs against a real server: streaming, cancel, deadline, health, reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

SERVER_MODEL = "tiny"  # protocol behaviour, not text quality
SERVER_ARGS = ("--max-request-bytes", "65536")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.InferenceServiceStub:
    return pb_grpc.InferenceServiceStub(channel)


def _greedy(max_tokens: int, **kwargs) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def test_generate_streams_deltas_then_usage_and_timing(stub) -> None:
    responses = list(
        stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_greedy(8), request_id="g-1"), timeout=120)
    )
    assert all(r.request_id == "g-1" for r in responses)
    assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]
    last = responses[-1]
    token_ids = [t for r in responses for d in r.deltas for t in d.token_ids]
    assert last.usage.completion_tokens == len(token_ids) <= 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert last.deltas[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert last.timing.time_to_first_token_seconds > 0 and last.timing.e2e_latency_seconds > 0
    text = "".join(d.text for r in responses for d in r.deltas)
    # Same greedy continuation from token ids as from text.
    ids = stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=True)).token_ids
    again = list(
        stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=_greedy(8)))
    )
    assert "".join(d.text for r in again for d in r.deltas) == text


def test_generate_streams_in_pieces(stub) -> None:
    """More than one message for a client that keeps up. Updates ready at once are merged, so a
    short fast generation may be one message on a loaded machine: 96 tokens with EOS ignored, and
    two more tries before calling it one blob (a server that never streams fails all three)."""
    counts = []
    for _ in range(3):
        request = pb.GenerateRequest(prompt=PROMPT, sampling=_greedy(96, ignore_eos=True))
        counts.append(len(list(stub.Generate(request, timeout=120))))
        if counts[-1] >= 2:
            break
    assert counts[-1] >= 2, f"messages per streamed generation: {counts}"


def test_chat_and_logprobs(stub) -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hello!")])
    responses = list(
        stub.Generate(pb.GenerateRequest(chat=chat, sampling=_greedy(4, logprobs=2)), timeout=120)
    )
    positions = [p for r in responses for d in r.deltas for p in d.logprobs]
    assert len(positions) == responses[-1].usage.completion_tokens
    assert all(p.sampled.logprob <= 0 and len(p.top) <= 2 for p in positions)


def test_tokenize_and_model_info(stub) -> None:
    tok = stub.Tokenize(pb.TokenizeRequest(text="hello world"))
    assert tok.count == len(tok.token_ids) >= 2 and tok.max_model_len == 1024
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.served_model_name and info.architecture == "llama" and info.vocab_size == 258
    assert info.max_model_len == 1024 and info.num_layers > 0


def test_cancel_mid_stream_frees_kv_blocks(stub, server) -> None:
    call = stub.Generate(
        pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=990, ignore_eos=True))
    )
    first = next(call)
    assert first.deltas
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    server.wait_idle()


def test_deadline_aborts_engine_request(stub, server) -> None:
    request = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=990, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_idle()


def test_health_serving_and_reflection_lists_services(channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pagedinfer.v1.InferenceService"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=service)).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(reflection.ServerReflectionInfo(iter([request])))
    names = {s.name for s in response.list_services_response.service}
    assert {
        "pagedinfer.v1.InferenceService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    by_symbol = reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="pagedinfer.v1.InferenceService"
    )
    (response,) = list(reflection.ServerReflectionInfo(iter([by_symbol])))
    assert response.file_descriptor_response.file_descriptor_proto


BAD = [
    (
        "max_tokens zero",
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "max_tokens too large",
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=10**6)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "temperature",
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=9)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "top_p",
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=1.5)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "n",
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(n=99)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "no input",
        pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "prompt too long",
        pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[17] * 1100)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "token out of vocab",
        pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[-5])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    ("unknown model", pb.GenerateRequest(prompt="hi", model="nope"), grpc.StatusCode.INVALID_ARGUMENT),
]


@pytest.mark.parametrize(("case", "request_msg", "code"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_status_codes(stub, case, request_msg, code) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_msg, timeout=30))
    assert err.value.code() == code and err.value.details()


def test_malformed_and_oversized_protobuf(channel) -> None:
    raw = channel.unary_stream("/pagedinfer.v1.InferenceService/Generate")
    with pytest.raises(grpc.RpcError) as err:
        list(raw(b"\xff\xff\xff\x0f", timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in err.value.details()
    big = pb.GenerateRequest(prompt="a" * 100_000).SerializeToString()
    with pytest.raises(grpc.RpcError) as err:
        list(raw(big, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
