"""Load generator of bench/serving.py: streaming gRPC and OpenAI SSE clients, run in their own
processes so that the clients' Python (protobuf/JSON parsing, httpx, asyncio) never shares a
GIL, and on a big host never a core, with the server or with each other.

`ClientPool(k, ...)` keeps k spawned worker processes, each with one event loop, one gRPC
channel and one httpx client for its whole life. `run_level` splits N closed-loop clients over
the workers (client i on worker i % k), starts them all at one agreed monotonic instant and
returns every request's client-side timing plus the wall time from the first start to the
last finish (CLOCK_MONOTONIC is one clock for all processes of the host).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import httpx


@dataclass
class RequestResult:
    ttft: float  # send -> first token, seconds
    itls: list[float]  # gaps between token-carrying messages, per token
    num_tokens: int


class Timer:
    """Client-side token timing of one streamed request."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.ttft = float("nan")
        self.itls: list[float] = []
        self.num_tokens = 0

    def tokens(self, k: int) -> None:
        if k <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.start
        else:
            self.itls.extend([(now - self.last) / k] * k)
        self.last = now
        self.num_tokens += k

    def result(self) -> RequestResult:
        return RequestResult(self.ttft, self.itls, self.num_tokens)


async def http_request(
    client: httpx.AsyncClient, url: str, prompt_ids: list[int], max_tokens: int
) -> RequestResult:
    body = {
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timer = Timer()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                # One SSE chunk per engine output of this request; a chunk that carries several
                # tokens (the server coalesces when this client lags) counts once here, so HTTP
                # ITL is per chunk. The usage chunk below makes the token count exact.
                timer.tokens(1)
            elif chunk.get("usage"):
                timer.num_tokens = chunk["usage"]["completion_tokens"]
    return timer.result()


async def grpc_request(stub, pb, prompt_ids: list[int], max_tokens: int) -> RequestResult:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_ids), sampling=sampling)
    timer = Timer()
    async for response in stub.Generate(request):
        timer.tokens(sum(len(d.token_ids) for d in response.deltas))
    return timer.result()


# ---- worker processes -------------------------------------------------------------------------
class _Worker:
    """One client process: a persistent event loop with its connections."""

    def __init__(self, ports: dict[str, tuple[int, int | None]], max_tokens: int, max_clients: int) -> None:
        import grpc

        from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
        from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.max_tokens = max_tokens
        self.pb = pb
        limits = httpx.Limits(max_connections=max_clients + 4, max_keepalive_connections=max_clients + 4)
        self.client = httpx.AsyncClient(timeout=None, limits=limits)
        self.urls = {label: f"http://127.0.0.1:{http}" for label, (http, _) in ports.items()}
        self.channels = {  # a server without gRPC (vLLM: bench/serving_vllm.py) has port None
            label: grpc.aio.insecure_channel(f"127.0.0.1:{g}") for label, (_, g) in ports.items() if g
        }
        self.stubs = {label: pb_grpc.InferenceServiceStub(ch) for label, ch in self.channels.items()}

    def one(self, mode: str, prompt_ids: list[int]):
        """mode: "grpc" | "http", optionally "/LABEL" for a variant server."""
        protocol, _, label = mode.partition("/")
        if protocol == "grpc":
            return grpc_request(self.stubs[label], self.pb, prompt_ids, self.max_tokens)
        return http_request(self.client, self.urls[label], prompt_ids, self.max_tokens)

    async def clients(
        self, mode: str, jobs: list[list[list[int]]], start_at: float
    ) -> tuple[list[RequestResult], float, float]:
        channel = self.channels.get(mode.partition("/")[2])
        if channel is not None:
            await channel.channel_ready()
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        start = time.monotonic()

        async def client(prompts: list[list[int]]) -> list[RequestResult]:
            return [await self.one(mode, ids) for ids in prompts]

        groups = await asyncio.gather(*(client(p) for p in jobs))
        return [r for g in groups for r in g], start, time.monotonic()


_WORKER: _Worker | None = None  # one per worker process, set by the pool's initializer


def _init_worker(ports: dict[str, tuple[int, int | None]], max_tokens: int, max_clients: int) -> None:
    global _WORKER
    _WORKER = _Worker(ports, max_tokens, max_clients)


def _run_clients(mode: str, jobs: list[list[list[int]]], start_at: float):
    """(results, start, end, CPU seconds this worker spent on them)."""
    assert _WORKER is not None
    cpu = time.process_time()
    results, start, end = _WORKER.loop.run_until_complete(_WORKER.clients(mode, jobs, start_at))
    return results, start, end, time.process_time() - cpu


def _warm(mode: str, prompt_ids: list[int], hold: float) -> int:
    """One untimed request; `hold` keeps this worker busy so each warm job lands on its own."""
    assert _WORKER is not None
    _WORKER.loop.run_until_complete(_WORKER.one(mode, prompt_ids))
    time.sleep(hold)
    return multiprocessing.current_process().pid or 0


class ClientPool:
    """k client processes (spawned: no inherited CUDA or threads) that run N clients per level."""

    def __init__(
        self, num_procs: int, ports: dict[str, tuple[int, int | None]], max_tokens: int, max_clients: int
    ):
        """ports: server label ("" for the base server) -> (HTTP port, gRPC port or None)."""
        self.num_procs = num_procs
        self.last_cpu_s = 0.0
        self._pool = ProcessPoolExecutor(
            num_procs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(ports, max_tokens, -(-max_clients // num_procs)),
        )

    def warm(self, modes: list[str], prompt_ids: list[int]) -> None:
        for mode in modes:
            jobs = [self._pool.submit(_warm, mode, prompt_ids, 0.5) for _ in range(self.num_procs)]
            [f.result() for f in jobs]

    async def run_level(
        self, mode: str, n: int, per_client: int, prompts: list[list[int]]
    ) -> tuple[list[RequestResult], float]:
        """Client i sends prompts[i * per_client : (i + 1) * per_client] one after the other."""
        k = min(self.num_procs, n)
        per_worker = [
            [prompts[i * per_client : (i + 1) * per_client] for i in range(w, n, k)] for w in range(k)
        ]
        start_at = time.monotonic() + 0.3  # every worker has picked its job up by then
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(
            *(loop.run_in_executor(self._pool, _run_clients, mode, jobs, start_at) for jobs in per_worker)
        )
        results = [r for rs, _, _, _ in parts for r in rs]
        self.last_cpu_s = sum(cpu for _, _, _, cpu in parts)  # all client workers of this level
        return results, max(end for _, _, end, _ in parts) - min(start for _, start, _, _ in parts)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
