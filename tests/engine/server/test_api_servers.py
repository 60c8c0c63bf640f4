"""`pagedinfer serve --api-server-count 2` on loopback (tiny random model): HTTP and gRPC
connections spread over both API-server processes with the same greedy text as one server,
/metrics summed over the processes but engine gauges not doubled, KV blocks freed, a held gRPC
port fails before anything starts, SIGTERM drains every process, and no process outlives the
launcher."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedinfer.engine.server.api_servers import bind_http_sockets, reserve_grpc_port
from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

SERVER_MODEL = "tiny"
SERVER_ARGS = ("--api-server-count", "2")
NUM_STREAMS = 24
NUM_GRPC_CHANNELS = 16
STREAM_TOKENS = 2000  # the drained streams: long enough (seconds) to be in flight at SIGTERM
pytestmark = pytest.mark.timeout(300)


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc: no psutil here)."""
    found = []
    for entry in Path("/proc").iterdir():
        stat = _stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat[1] == pid:
            found.append(int(entry.name))
    return found


def _spawned(pids: list[int]) -> list[int]:
    """Those started by multiprocessing's spawn (not its resource tracker)."""
    return [pid for pid in pids if b"spawn_main" in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[1])


def _is_running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie has exited (its reaper may be slow)


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(_is_running(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if _is_running(pid)]
        time.sleep(0.1)


async def _stream_all(base_url: str, model: str, num_streams: int) -> list[str]:
    """`num_streams` simultaneous streaming chat requests, each on a client (connection) of its own."""

    async def one(i: int) -> str:
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=120
        ) as client:
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"request {i}: say something"}],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    return await asyncio.gather(*(one(i) for i in range(num_streams)))


def _metrics(proc) -> dict[str, list]:
    text = httpx.get(f"{proc.http}/metrics", timeout=10).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _value(samples: list, name: str, **labels: str) -> float:
    return sum(
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_streams_spread_over_both_processes_same_text_summed_metrics(
    server, server_proc_cls, tiny_model
) -> None:
    model = httpx.get(f"{server.http}/v1/models", timeout=10).json()["data"][0]["id"]
    texts = asyncio.run(_stream_all(f"{server.http}/v1", model, NUM_STREAMS))
    assert all(texts) and len(set(texts)) > 1, texts
    single = server_proc_cls(model=tiny_model).start()
    try:
        single.wait_ready()
        expected = asyncio.run(_stream_all(f"{single.http}/v1", model, NUM_STREAMS))
    finally:
        assert single.stop() == 0, single.log()[-3000:]
    assert texts == expected

    stats = server.wait_idle()  # every KV block free again (the core's stats, as either process mirrors them)
    metrics = _metrics(server)
    per_server = [
        _value(
            metrics["pagedinfer_api_server_requests"],
            "pagedinfer_api_server_requests_total",
            api_server=str(i),
        )
        for i in (0, 1)
    ]
    assert sum(per_server) == NUM_STREAMS and min(per_server) > 0, per_server  # both processes served
    requests = _value(metrics["pagedinfer_requests"], "pagedinfer_requests_total", finish_reason="length")
    assert requests == NUM_STREAMS  # summed over the processes
    assert (
        _value(
            metrics["pagedinfer_e2e_request_latency_seconds"], "pagedinfer_e2e_request_latency_seconds_count"
        )
        == NUM_STREAMS
    )
    assert (
        _value(metrics["pagedinfer_generation_tokens"], "pagedinfer_generation_tokens_total")
        == NUM_STREAMS * 8
    )
    # Engine gauges: one engine's numbers, not one per process.
    total_blocks = stats["engine"]["kv_total_blocks"]
    assert (
        _value(metrics["pagedinfer_kv_cache_total_blocks"], "pagedinfer_kv_cache_total_blocks")
        == total_blocks
    )
    assert (
        _value(metrics["pagedinfer_kv_cache_free_blocks"], "pagedinfer_kv_cache_free_blocks") == total_blocks
    )
    assert _value(metrics["pagedinfer_server_ready"], "pagedinfer_server_ready") == 1.0
    assert len(metrics["pagedinfer_kv_cache_total_blocks"]) == 1


def _requests_per_server(proc) -> list[float]:
    samples = _metrics(proc)["pagedinfer_api_server_requests"]
    return [_value(samples, "pagedinfer_api_server_requests_total", api_server=str(i)) for i in (0, 1)]


def _generate_on_own_connection(target: str, i: int) -> list:
    # Channels of one process share a connection (the global subchannel pool) unless each has
    # a pool of its own: then each is a TCP connection of its own, as a client process's is.
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(target, options=options) as channel:
        request = pb.GenerateRequest(
            prompt=f"request {i}", sampling=pb.SamplingParams(max_tokens=4, temperature=0)
        )
        return list(pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=120))


def test_grpc_connections_spread_over_both_processes(server) -> None:
    ports = re.findall(r"API server \d \(pid \d+\) accepts on ports \d+, (\d+) \(gRPC\)", server.log())
    assert ports == [str(server.grpc_port)] * 2, ports  # both joined the one reserved port
    before = _requests_per_server(server)
    with ThreadPoolExecutor(NUM_GRPC_CHANNELS) as pool:
        results = list(
            pool.map(partial(_generate_on_own_connection, server.grpc_target), range(NUM_GRPC_CHANNELS))
        )
    assert all(r[-1].finished and r[-1].usage.completion_tokens == 4 for r in results), results
    deadline = time.monotonic() + 30
    while (
        sum(served := [a - b for a, b in zip(_requests_per_server(server), before, strict=True)])
        < NUM_GRPC_CHANNELS
    ):
        assert time.monotonic() < deadline, served  # counted as each stream's handler ends
        time.sleep(0.1)
    # Each connection is hashed to one process: P(all 16 on one of two) = 2^-15.
    assert sum(served) == NUM_GRPC_CHANNELS and min(served) > 0, served


def test_the_grpc_port_reservation_takes_no_connections_and_fails_on_a_held_port() -> None:
    """What the launcher relies on, on this machine's kernel: the reservation (bound, not
    listening) refuses connections alone and takes none beside listeners, yet keeps others out."""
    with reserve_grpc_port("127.0.0.1", 0) as reservation:
        port = reservation.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        listeners = [_reuseport_listener(port) for _ in range(2)]  # as the API servers' gRPC servers
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(64)]
        accepted = [0, 0]
        deadline = time.monotonic() + 10
        while sum(accepted) < len(clients):
            assert time.monotonic() < deadline, accepted
            for i, listener in enumerate(listeners):
                with contextlib.suppress(BlockingIOError):
                    listener.accept()[0].close()
                    accepted[i] += 1
        assert min(accepted) > 0, accepted
        for sock in clients + listeners:
            sock.close()
        for reuse_addr in (0, 1):  # with the reservation alone: a socket without SO_REUSEPORT is kept out
            with socket.socket() as other, pytest.raises(OSError):
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse_addr)
                other.bind(("127.0.0.1", port))
                other.listen()
    with reserve_grpc_port("0.0.0.0", 0) as wildcard, socket.socket() as other, pytest.raises(OSError):
        other.bind(("0.0.0.0", wildcard.getsockname()[1]))  # gRPC's dual-stack [::] bind: IPv4 kept out
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(SystemExit, match="cannot bind gRPC to 127.0.0.1"):
            reserve_grpc_port("127.0.0.1", held.getsockname()[1])


def test_a_port_with_a_reuseport_listener_of_this_user_is_refused_not_joined() -> None:
    """Another launcher or any grpcio server (SO_REUSEPORT by default) on the port: our own
    SO_REUSEPORT binds would join it and split its traffic; the launcher refuses instead."""
    with _reuseport_listener(0) as other:
        port = other.getsockname()[1]
        with pytest.raises(SystemExit, match="cannot bind gRPC to 127.0.0.1"):
            reserve_grpc_port("127.0.0.1", port)
        with pytest.raises(SystemExit, match="cannot bind HTTP to 127.0.0.1"):
            bind_http_sockets("127.0.0.1", port, 2)
    with reserve_grpc_port("127.0.0.1", port) as reservation:  # free again: taken
        assert reservation.getsockname()[1] == port
    sockets = bind_http_sockets("127.0.0.1", port, 2)
    assert [sock.getsockname()[1] for sock in sockets] == [port, port]
    for sock in sockets:
        sock.close()


def _reuseport_listener(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def test_a_grpc_port_held_by_another_program_fails_once_before_anything_starts(
    server_proc_cls, tiny_model
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        proc = server_proc_cls(extra_args=SERVER_ARGS, model=tiny_model, grpc_port=held.getsockname()[1])
        try:
            code = proc.start().proc.wait(120)
        finally:
            proc.stop()
    log = proc.log()
    assert code == 1 and log.count("cannot bind gRPC to 127.0.0.1:") == 1, log
    assert "engine core" not in log and "API server" not in log, log  # nothing was started


def test_sigterm_drains_in_flight_streams_on_every_process_and_exits_0(server_proc_cls, tiny_model) -> None:
    # Seats for all 12 streams (the default 8 left 4 queued: most streams had finished when the
    # last one started, and the few still in flight could all sit on one process), and a drain
    # bound well above the streams' length on a slow machine.
    extra = (*SERVER_ARGS, "--max-model-len", "2048", "--max-num-seqs", "16", "--drain-timeout", "60")
    proc = server_proc_cls(extra_args=extra, model=tiny_model).start()
    try:
        proc.wait_ready()
        pids = _children(proc.proc.pid)
        assert len(_spawned(pids)) == 3, pids  # the core and two API servers
        results: list[list[dict]] = [[] for _ in range(12)]  # P(all on one process) = 2^-11
        started = [threading.Event() for _ in results]
        threads = [
            threading.Thread(target=_long_stream, args=(proc, results[i], started[i]))
            for i in range(len(results))
        ]
        for thread in threads:
            thread.start()
        assert all(event.wait(120) for event in started)
        proc.proc.send_signal(signal.SIGTERM)
        try:
            _expect_refusing(proc)
        except httpx.ConnectError as exc:
            raise AssertionError(f"{exc}: {[len(c) for c in results]}\n{proc.log()[-3000:]}") from exc
        for thread in threads:
            thread.join(120)
        assert proc.proc.wait(120) == 0, proc.log()[-4000:]
    finally:
        proc.stop()
    for chunks in results:  # every in-flight stream ran to its end
        assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == [STREAM_TOKENS], chunks[
            -2:
        ]
    _wait_gone(pids)
    drained = [int(n) for n in re.findall(r"\[[01]\]: shutting down: draining (\d+) in-flight", proc.log())]
    assert len(drained) == 2 and min(drained) > 0, drained  # both processes had streams to drain
    assert "API servers exited with [0, 0]" in proc.log()
    assert "[0]: shut down (drained)" in proc.log() and "[1]: shut down (drained)" in proc.log()


def _long_stream(proc, chunks: list[dict], started: threading.Event) -> None:
    body = {"prompt": "Tell me a story.", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    try:
        with httpx.stream("POST", f"{proc.http}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):  # parsed only where needed: the test's GIL is shared
                    started.set()
                    if '"usage"' in line:
                        chunks.append(json.loads(line[6:]))
            if r.status_code != 200:
                chunks.append({"status": r.status_code, "body": r.read().decode()})
    finally:
        started.set()  # (a refused stream fails the usage check below)


def _expect_refusing(proc) -> None:
    """After SIGTERM every process refuses: new connections land on both (one client each)."""
    deadline = time.monotonic() + 10
    refused = 0
    while refused < 4:
        r = httpx.post(f"{proc.http}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        if r.status_code == 503:
            assert "shutting down" in r.json()["error"]["message"]
            refused += 1
        else:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.05)
    assert httpx.get(f"{proc.http}/ready", timeout=5).status_code == 503


def test_api_servers_and_core_exit_when_the_launcher_is_killed(server_proc_cls, tiny_model) -> None:
    proc = server_proc_cls(extra_args=SERVER_ARGS, model=tiny_model).start()
    try:
        proc.wait_ready()
        pids = _children(proc.proc.pid)
        assert len(_spawned(pids)) == 3, pids
        os.kill(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(10)
        _wait_gone(pids)
    finally:
        proc.stop()


def test_a_dead_engine_core_fails_the_probes_of_every_api_server(server_proc_cls, tiny_model) -> None:
    proc = server_proc_cls(extra_args=SERVER_ARGS, model=tiny_model).start()
    try:
        proc.wait_ready()
        core_pid = int(re.search(r"engine core pid (\d+)", proc.log()).group(1))
        os.kill(core_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        dead = 0
        while dead < 8:  # eight fresh connections in a row: both processes know (P(one unasked) = 2^-7)
            assert time.monotonic() < deadline, proc.log()[-3000:]
            health = httpx.get(f"{proc.http}/health", timeout=5)
            dead = dead + 1 if health.status_code == 503 and "engine died" in health.json()["error"] else 0
        r = httpx.post(f"{proc.http}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


async def _complete_repetitive(base_url: str, model: str, num_streams: int, max_tokens: int) -> None:
    """Streams whose prompt the tiny model's continuation repeats (n-gram drafts match)."""

    async def one(i: int) -> None:
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=120
        ) as client:
            stream = await client.completions.create(
                model=model,
                prompt="ab " * (12 + i),
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                pass

    await asyncio.gather(*(one(i) for i in range(num_streams)))


def test_engine_counters_never_go_back_between_scrapes_of_different_processes(
    server_proc_cls, tiny_model
) -> None:
    """Each scrape on a new connection may land on either process, whose mirrors of the core
    lag by up to 0.1 s: a counter read from them went back between scrapes (a reset to
    Prometheus). The speculative-decoding and preemption counters are counted once, from the
    steps, so every scrape sees one nondecreasing series, and the same value on both processes
    once idle."""
    args = ("--api-server-count", "2", "--speculative-method", "ngram", "--num-speculative-tokens", "3")
    proc = server_proc_cls(model=tiny_model, extra_args=(*args, "--num-blocks", "40")).start()
    names = (
        ("pagedinfer_spec_decode_draft_tokens", "pagedinfer_spec_decode_draft_tokens_total"),
        ("pagedinfer_spec_decode_accepted_tokens", "pagedinfer_spec_decode_accepted_tokens_total"),
        ("pagedinfer_preemptions", "pagedinfer_preemptions_total"),
    )

    def scrape() -> tuple[float, ...]:
        metrics = _metrics(proc)  # (httpx.get: a new connection each time)
        assert all(len(metrics[family]) == 1 for family, _ in names)  # one series, not one per process
        return tuple(_value(metrics[family], sample) for family, sample in names)

    try:
        proc.wait_ready()
        model = httpx.get(f"{proc.http}/v1/models", timeout=10).json()["data"][0]["id"]
        seen: list[tuple[float, ...]] = []
        done = threading.Event()

        def scrape_until_done() -> None:
            while not done.is_set():
                seen.append(scrape())

        with ThreadPoolExecutor(1) as pool:
            scraping = pool.submit(scrape_until_done)
            try:
                # One stream at a time: the process that does not serve it gets the core's stats
                # only every 0.1 s, so the two mirrors differ most of the time.
                for _ in range(3):
                    asyncio.run(_complete_repetitive(f"{proc.http}/v1", model, 1, max_tokens=300))
                # then three at once: ~66 blocks of 40, so the scheduler preempts
                asyncio.run(_complete_repetitive(f"{proc.http}/v1", model, 3, max_tokens=300))
            finally:
                done.set()
            scraping.result()
        proc.wait_idle()
        # Idle, both processes converge (API server 0, the one that counts, may get the core's
        # last message a moment after the other): until 8 scrapes in a row agree.
        idle: list[tuple[float, ...]] = []
        deadline = time.monotonic() + 30
        while len(idle) < 8 or len(set(idle[-8:])) > 1:
            assert time.monotonic() < deadline, idle[-16:]
            idle.append(scrape())
            time.sleep(0.02)
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]
    series = seen + idle
    drafts, _, preemptions = idle[-1]
    assert len(seen) > 10 and drafts > 0 and preemptions > 0, (len(seen), idle[-1])
    for i in range(len(names)):
        values = [s[i] for s in series]
        assert values == sorted(values), (names[i][1], values)
