"""The .proto compiles with grpcio-tools and the stubs in use are the ones it produces."""

from __future__ import annotations

from pathlib import Path

from pagedinfer.engine.server import proto_gen


def test_proto_compiles_and_matches_stubs_in_use(tmp_path: Path) -> None:
    out = proto_gen.generate(tmp_path)
    in_use = Path(proto_gen.ensure_stubs())
    for name in proto_gen.STUB_NAMES:
        assert (out / name).read_text() == (in_use / name).read_text(), f"{name} is stale"


def test_service_surface() -> None:
    from pagedinfer.engine.server.proto_gen import inference_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["InferenceService"]
    assert service.full_name == "pagedinfer.v1.InferenceService"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Tokenize", "Detokenize", "GetModelInfo"}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=3), priority=2)
    assert pb.GenerateRequest.FromString(request.SerializeToString()) == request
    assert not request.sampling.HasField("temperature")  # unset optionals take engine defaults


def test_stale_stubs_are_regenerated(tmp_path: Path) -> None:
    out = proto_gen.generate(tmp_path)
    digest = proto_gen.proto_hash(proto_gen.proto_root())
    assert proto_gen._is_current(out, digest)
    stub = out / proto_gen.STUB_NAMES[0]
    stub.write_text("# pagedinfer-proto-sha256: 0000\n" + stub.read_text().split("\n", 1)[1])
    assert not proto_gen._is_current(out, digest)
