"""docker/cluster/smoke.py against in-process stand-ins for the engine's two APIs: a grpc.server
with the real InferenceService stubs and an HTTP server answering /v1/chat/completions."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


def _load_smoke():
    spec = importlib.util.spec_from_file_location("cluster_smoke", ROOT / "docker" / "cluster" / "smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


smoke = _load_smoke()


@dataclass
class Seen:
    """What the stand-ins received."""

    grpc_requests: list[pb.GenerateRequest] = field(default_factory=list)
    grpc_auth: list[str | None] = field(default_factory=list)
    http_bodies: list[dict] = field(default_factory=list)
    http_auth: list[str | None] = field(default_factory=list)
    grpc_error: bool = False
    http_text: str = "Paris"


class FakeInference(pb_grpc.InferenceServiceServicer):
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def Generate(self, request, context) -> Iterator[pb.GenerateResponse]:  # noqa: N802 (gRPC name)
        self.seen.grpc_requests.append(request)
        self.seen.grpc_auth.append(dict(context.invocation_metadata()).get("authorization"))
        if self.seen.grpc_error:
            delta = pb.SequenceDelta(index=0, finish_reason=pb.FINISH_REASON_ERROR, error="cannot fit")
            yield pb.GenerateResponse(request_id="r", deltas=[delta], finished=True)
            return
        yield pb.GenerateResponse(request_id="r", deltas=[pb.SequenceDelta(index=0, text="Par")])
        last = pb.SequenceDelta(index=0, text="is", finish_reason=pb.FINISH_REASON_STOP)
        yield pb.GenerateResponse(request_id="r", deltas=[last], finished=True)


def _http_handler(seen: Seen):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.http_bodies.append(body)
            seen.http_auth.append(self.headers.get("Authorization"))
            if self.path != "/v1/chat/completions":
                self.send_error(404)
                return
            reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": seen.http_text}}]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Handler


@pytest.fixture
def engine():
    seen = Seen()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_InferenceServiceServicer_to_server(FakeInference(seen), server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(seen))
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield seen, f"http://127.0.0.1:{http.server_address[1]}", f"127.0.0.1:{grpc_port}"
    http.shutdown()
    server.stop(grace=None)


def test_both_apis_answer(engine, capsys, monkeypatch):
    monkeypatch.delenv("PAGEDINFER_API_KEY", raising=False)
    seen, http_url, grpc_addr = engine
    rc = smoke.main(["--http", http_url, "--grpc", grpc_addr, "--model", "smollm2", "--timeout", "10"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "gRPC   -> 'Paris'" in out and "OpenAI -> 'Paris'" in out
    (req,) = seen.grpc_requests
    assert req.model == "smollm2" and req.WhichOneof("input") == "chat"
    assert req.chat.messages[0].role == "user" and req.sampling.max_tokens == 16
    assert seen.http_bodies[0]["model"] == "smollm2"
    assert seen.grpc_auth == [None] and seen.http_auth == [None]


def test_api_key_goes_to_both_protocols(engine, monkeypatch):
    monkeypatch.setenv("PAGEDINFER_API_KEY", "s3cret")
    seen, http_url, grpc_addr = engine
    assert smoke.main(["--http", http_url, "--grpc", grpc_addr, "--timeout", "10"]) == 0
    assert seen.grpc_auth == ["Bearer s3cret"] and seen.http_auth == ["Bearer s3cret"]


def test_engine_error_fails(engine, capsys):
    seen, http_url, grpc_addr = engine
    seen.grpc_error = True
    assert smoke.main(["--http", http_url, "--grpc", grpc_addr, "--timeout", "10"]) == 1
    assert "cannot fit" in capsys.readouterr().err


def test_empty_answer_fails(engine, capsys):
    seen, http_url, grpc_addr = engine
    seen.http_text = "  "
    assert smoke.main(["--http", http_url, "--grpc", grpc_addr, "--timeout", "10"]) == 1
    assert "OpenAI answer is empty" in capsys.readouterr().err


def test_nothing_listening_fails_at_the_deadline(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = smoke.main(["--http", f"http://127.0.0.1:{port}", "--grpc", f"127.0.0.1:{port}", "--timeout", "2"])
    assert rc == 1
    assert "no answer before the deadline" in capsys.readouterr().err
