"""The event loop `pagedinfer serve` runs HTTP and gRPC on: uvicorn's choice, uvloop where it
imports, asyncio otherwise; both loops serve gRPC and HTTP and drain on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import sys

import grpc
import httpx
import pytest
import uvloop

from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc
from pagedinfer.engine.server.serve import event_loop_factory


def _loop_type(name: str) -> type:
    loop = event_loop_factory(name)()
    try:
        return type(loop)
    finally:
        loop.close()


def test_auto_and_uvloop_give_uvloop_asyncio_gives_the_selector_loop() -> None:
    assert _loop_type("auto") is uvloop.Loop
    assert _loop_type("uvloop") is uvloop.Loop
    assert issubclass(_loop_type("asyncio"), asyncio.SelectorEventLoop)


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now raises ImportError
    monkeypatch.delitem(sys.modules, "uvicorn.loops.uvloop", raising=False)
    assert issubclass(_loop_type("auto"), asyncio.SelectorEventLoop)
    with pytest.raises(SystemExit, match="event loop uvloop"):
        event_loop_factory("uvloop")


@pytest.mark.parametrize(
    ("has_uvloop", "loop_name"),
    [(True, "uvloop.Loop"), (False, "asyncio.unix_events._UnixSelectorEventLoop")],
)
def test_grpc_and_http_stream_on_the_loop_then_sigterm_exits_0(
    server_proc_cls, tiny_model, tmp_path, has_uvloop, loop_name
) -> None:
    env = {}
    if not has_uvloop:  # a `uvloop` package first on the path that fails to import: auto falls back
        (tmp_path / "uvloop").mkdir()
        (tmp_path / "uvloop" / "__init__.py").write_text("raise ImportError('uvloop hidden by the test')\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc = server_proc_cls(model=tiny_model, env=env).start()
    try:
        proc.wait_ready()
        assert f"event loop: {loop_name}\n" in proc.log(), proc.log()[-2000:]
        # --api-server-count auto on the CPU: one API server, the engine in-process, no launcher.
        assert "--api-server-count auto: 1 (the engine core runs in this process)\n" in proc.log()
        assert "launcher (pid" not in proc.log() and "API server 0" not in proc.log(), proc.log()[-2000:]
        with grpc.insecure_channel(proc.grpc_target) as channel:
            request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=4, temperature=0))
            responses = list(pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=60))
        assert responses[-1].finished and responses[-1].usage.completion_tokens >= 1
        body = {"prompt": "hi", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{proc.http}/v1/completions", json=body, timeout=60) as r:
            lines = [li for li in r.iter_lines() if li.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines
    finally:
        code = proc.stop()
    assert code == 0, proc.log()[-4000:]
