"""The default model (SmolLM2) end to end: startup observable while loading, a real answer
through the OpenAI SDK, then SIGTERM drains the in-flight request and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc


@pytest.mark.parametrize(
    "extra_args",
    [(), ("--engine-process",)],
    ids=["in-process", "engine-process"],
)
def test_startup_probes_while_loading_then_sigterm_drain(server_proc_cls, extra_args) -> None:
    proc = server_proc_cls(extra_args=extra_args).start()
    try:
        phases = _watch_startup(proc)
        assert phases[0][0] == 503 and phases[-1] == (200, "ready"), phases
        assert any(code == 503 and phase not in ("ready", "failed") for code, phase in phases), phases
        log = proc.log()
        line = next(li for li in log.splitlines() if "serving:" in li)
        for url in ("/v1", "/v1/ws", "/metrics", f":{proc.grpc_port}", "/ready"):
            assert url in line, line
        _answers_paris(proc)
        _drain(proc)
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.log()[-4000:]


def _watch_startup(proc) -> list[tuple[int, str]]:
    """Poll /startup and /health from the moment HTTP answers until the model is loaded."""
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            ready = httpx.get(f"{proc.http}/ready", timeout=2).status_code
            r = httpx.get(f"{proc.http}/startup", timeout=2)
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        assert httpx.get(f"{proc.http}/health", timeout=2).status_code == 200
        assert ready == 503 or r.status_code == 200  # ready implies startup finished (checked in that order)
        entry = (r.status_code, r.json()["phase"])
        if not seen or seen[-1] != entry:
            seen.append(entry)
        if r.status_code == 200:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"never became ready: {seen}\n{proc.log()[-3000:]}")


def _answers_paris(proc) -> None:
    client = openai.OpenAI(base_url=f"{proc.http}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "smollm2-135m"
    out = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert "Paris" in out.choices[0].text, out


def _drain(proc) -> None:
    body = {"prompt": "Tell me a story.", "max_tokens": 8, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    chunks: list[dict] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{proc.http}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(120)
    proc.proc.send_signal(signal.SIGTERM)
    _expect_refusing(proc)
    reader.join(120)
    assert proc.proc.wait(60) == 0, proc.log()[-4000:]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals and finals[-1]["choices"][0]["finish_reason"] == "length", chunks[-2:]
    # the in-flight request ran to its end (a chunk may carry several tokens when the reader lags)
    assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == [8], chunks[-2:]


def _expect_refusing(proc) -> None:
    """Right after SIGTERM: not ready, new requests refused, gRPC health NOT_SERVING."""
    deadline = time.monotonic() + 10
    while httpx.get(f"{proc.http}/ready", timeout=5).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(f"{proc.http}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    with grpc.insecure_channel(proc.grpc_target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_dead_engine_process_fails_probes_and_grpc_health(server_proc_cls, tiny_model) -> None:
    """The engine core process killed (a crash, an OOM kill): the pod must report it so
    Kubernetes restarts it, instead of answering ready with an engine that cannot step."""
    proc = server_proc_cls(extra_args=("--engine-process",), model=tiny_model).start()
    try:
        proc.wait_ready()
        assert httpx.get(f"{proc.http}/health", timeout=5).status_code == 200
        os.kill(_engine_core_pid(proc.proc.pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{proc.http}/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, proc.log()[-3000:]
            time.sleep(0.05)
        health = httpx.get(f"{proc.http}/health", timeout=5)
        assert health.status_code == 503 and "engine died" in health.json()["error"], health.text
        r = httpx.post(f"{proc.http}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        with grpc.insecure_channel(proc.grpc_target) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            while (
                check(health_pb2.HealthCheckRequest(), timeout=5).status
                != health_pb2.HealthCheckResponse.NOT_SERVING
            ):
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        code = proc.stop()
    assert code == 0, proc.log()[-4000:]


def _engine_core_pid(server_pid: int) -> int:
    """The spawned engine core among the server's children (not multiprocessing's resource tracker)."""
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():  # the engine thread spawned it
        children += _read_proc(task / "children").split()
    for pid in children:
        if "spawn_main" in _read_proc(Path(f"/proc/{pid}/cmdline")):
            return int(pid)
    raise AssertionError(f"no engine core process among {children}")


def _read_proc(path: Path) -> str:
    """A /proc file's text, or "" when its thread or process ended during the scan."""
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""
