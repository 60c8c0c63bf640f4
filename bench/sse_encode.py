"""Server-side cost of one streamed OpenAI SSE chunk (issue 5: HTTP at N=64 on the H200).

Two measurements, both CPU-only:
1. render: microseconds to turn one engine output into its SSE text, three ways: a dict per
   chunk + json.dumps (the server before the templates), a pydantic model per chunk +
   model_dump_json (the common FastAPI way), and `SseRenderer` (per-stream JSON templates).
2. serve: the real HTTP app (`build_app`, all middleware) under uvicorn with a fake engine that
   has every token ready at once, so the server is the only work; M concurrent raw-socket
   clients read chat streams of K chunks. Reported: server process CPU microseconds per chunk
   (user + system from /proc, so client work on the same cores does not count), per HTTP
   implementation (h11, httptools when installed) and per routes module (`--routes-from FILE`
   loads another openai_api.py, e.g. `git show HEAD~1:engine/server/openai_api.py`, for
   before/after on one machine).

Run: .venv/bin/python bench/sse_encode.py [--chunks 20000] [--streams 64] [--tokens 256]
The peer/floor: the H200 run does ~8.5k chunks/s at N=64 in one server process; at C us/chunk
the server spends 8.5k * C us per second on chunks, e.g. 60 us -> 51% of its one core.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from pydantic import BaseModel

from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput, RequestTiming, Usage
from pagedinfer.engine.server.sse_render import SseRenderer, timing_dict

TIMING = RequestTiming(0.01, 0.02, 1.0, 1.02, 128.0)


def _outputs(num: int) -> list[RequestOutput]:
    outs = [RequestOutput("r", [CompletionDelta(0, f" w{i % 977}", [i])]) for i in range(num - 1)]
    last = CompletionDelta(0, " end", [1], finish_reason=FinishReason.LENGTH)
    return [*outs, RequestOutput("r", [last], True, Usage(128, num), TIMING)]


# --- 1. render ---------------------------------------------------------------------------


def render_dict(outs: list[RequestOutput]) -> int:
    """The pre-template server: a dict per chunk, json.dumps of all of it."""
    base = {"id": "chatcmpl-0123456789abcdef01234567", "object": "chat.completion.chunk"}
    base |= {"created": 1700000000, "model": "llama-8b"}
    started, size = set(), 0
    for out in outs:
        for d in out.deltas:
            delta = {"content": d.text}
            if d.index not in started:
                started.add(d.index)
                delta["role"] = "assistant"
            finish = d.finish_reason.value if d.finish_reason else None
            choice = {"index": d.index, "delta": delta, "logprobs": None, "finish_reason": finish}
            tail = {"timing": timing_dict(out.timing)} if out.finished else {}
            size += len(
                f"data: {json.dumps({**base, 'choices': [choice], **tail}, separators=(',', ':'))}\n\n"
            )
    return size


class _Delta(BaseModel):
    content: str
    role: str | None = None


class _Choice(BaseModel):
    index: int
    delta: _Delta
    logprobs: dict | None = None
    finish_reason: str | None = None


class _Chunk(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[_Choice]


def render_pydantic(outs: list[RequestOutput]) -> int:
    size = 0
    for out in outs:
        for d in out.deltas:
            finish = d.finish_reason.value if d.finish_reason else None
            choice = _Choice(index=d.index, delta=_Delta(content=d.text), finish_reason=finish)
            chunk = _Chunk(
                id="chatcmpl-0123456789abcdef01234567",
                object="chat.completion.chunk",
                created=1700000000,
                model="llama-8b",
                choices=[choice],
            )
            size += len(f"data: {chunk.model_dump_json(exclude_none=True)}\n\n")
    return size


def render_template(outs: list[RequestOutput]) -> int:
    r = SseRenderer(
        "chatcmpl-0123456789abcdef01234567", 1700000000, "llama-8b", "chat.completion.chunk", False
    )
    return sum(len(r.render(out).encode()) for out in outs)


def bench_render(num_chunks: int, repeats: int) -> dict[str, float]:
    outs = _outputs(num_chunks)
    result = {}
    for name, fn in (
        ("dict+json.dumps", render_dict),
        ("pydantic", render_pydantic),
        ("template", render_template),
    ):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(outs)
            times.append((time.perf_counter() - t0) / num_chunks * 1e6)
        result[name] = statistics.median(times)
        print(f"render {name:16s} {result[name]:6.2f} us/chunk (min {min(times):.2f}, max {max(times):.2f})")
    return result


# --- 2. serve ----------------------------------------------------------------------------


class _FakeEngine:
    """Every token is ready at once: the server's work is all that is left to measure."""

    model_config = SimpleNamespace(vocab_size=256)
    max_model_len = 1 << 20
    tokenizer = SimpleNamespace(encode_chat=lambda messages, add_generation_prompt: [1, 2, 3])

    async def generate(self, prompt_token_ids, sampling_params, priority, request_id):
        for out in _outputs(sampling_params.max_tokens):
            yield RequestOutput(request_id, out.deltas, out.finished, out.usage, out.timing)

    async def abort(self, request_id: str) -> None:
        return None


class _FakeHandle:
    engine = _FakeEngine()
    is_ready = True

    def require_engine(self) -> _FakeEngine:
        return self.engine

    def request_started(self) -> None:
        pass

    def request_finished(self) -> None:
        pass


def serve(port: int, http: str, routes_from: str | None) -> None:
    import uvicorn

    from pagedinfer.engine.config import ServerConfig
    from pagedinfer.engine.metrics import ServingMetrics
    from pagedinfer.engine.server import http_server
    from pagedinfer.engine.server.auth import ApiKeyAuth
    from pagedinfer.engine.server.generation import GenerationService

    if routes_from:  # another openai_api.py (before/after on one machine)
        spec = importlib.util.spec_from_file_location("routes_under_test", routes_from)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        http_server.OpenAIRoutes = module.OpenAIRoutes
    service = GenerationService(_FakeHandle(), ServingMetrics("llama-8b"))
    app = http_server.build_app(service, ServerConfig(), ApiKeyAuth(None))
    uvicorn.run(app, host="127.0.0.1", port=port, http=http, log_level="warning", lifespan="off")


async def _one_stream(port: int, tokens: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    ).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while not seen.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # chunked body ends
        data = await reader.read(1 << 16)
        if not data:
            raise RuntimeError(f"stream ended early: {seen[-200:]!r}")
        seen = seen[-64:] + data  # only the end matters
    writer.close()
    return tokens


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _load(port: int, streams: int, tokens: int) -> int:
    return sum(await asyncio.gather(*(_one_stream(port, tokens) for _ in range(streams))))


def _start(http: str, routes_from: str | None) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--serve", str(port), "--http", http]
    proc = subprocess.Popen(argv + (["--routes-from", routes_from] if routes_from else []))
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("server did not start") from None
            time.sleep(0.2)


def bench_serve(
    configs: list[tuple[str, str | None]], streams: int, tokens: int, rounds: int
) -> list[list[float]]:
    """Server CPU us per chunk for each (http, routes) config; rounds interleave the configs so
    that a noisy neighbour hits all of them alike."""
    servers = []
    try:
        for http, routes in configs:
            servers.append(_start(http, routes))
        for _, port in servers:
            asyncio.run(_load(port, 2, 16))  # warm-up
        per_chunk: list[list[float]] = [[] for _ in configs]
        for _ in range(rounds):
            for i, (proc, port) in enumerate(servers):
                cpu0 = _cpu_seconds(proc.pid)
                chunks = asyncio.run(_load(port, streams, tokens))
                per_chunk[i].append((_cpu_seconds(proc.pid) - cpu0) / chunks * 1e6)
        return per_chunk
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=20000, help="render: chunks per timing")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--streams", type=int, default=64, help="serve: concurrent streams")
    p.add_argument("--tokens", type=int, default=256, help="serve: chunks per stream")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--http", default=None, help="serve: h11, httptools or both (default: all installed)")
    p.add_argument(
        "--routes-from", action="append", default=[], metavar="FILE", help="serve: other openai_api.py"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        serve(args.serve, args.http, args.routes_from[0] if args.routes_from else None)
        return 0
    result = {"render_us_per_chunk": bench_render(args.chunks, args.repeats), "serve": []}
    https = args.http.split(",") if args.http else ["h11"] + (["httptools"] if _has("httptools") else [])
    configs = [(http, routes) for routes in [None, *args.routes_from] for http in https]
    results = bench_serve(configs, args.streams, args.tokens, args.rounds)
    for (http, routes), values in zip(configs, results, strict=True):
        label = f"{http} routes={routes or 'current'}"
        med = statistics.median(values)
        print(f"serve {label}: {med:.1f} us CPU/chunk (rounds {', '.join(f'{v:.1f}' for v in values)})")
        result["serve"].append({"http": http, "routes": routes or "current", "us_per_chunk": values})
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())
