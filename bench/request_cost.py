"""Server-side cost of one streamed OpenAI request (issue 5: HTTP TTFT at N=64 on the H200).

64 requests arrive within a millisecond at the start of each round of bench/serving.py; the
server takes them one after the other on one event loop, so its per-request work (HTTP parse,
routing, middleware, validation, prompt handling, the hand-off to the engine core) is paid
64 times before the last request's first token can leave. Measured here, CPU-only:

- the real HTTP app (`build_app`, all middleware) under uvicorn (httptools) with a fake engine
  that answers at once, in one of two shapes:
  `direct`: a fake AsyncEngine (the server's own path only, like bench/sse_encode.py);
  `remote`: the real AsyncEngine + RemoteCore (engine thread, pickled messages, reader and
  writer threads) in front of a fake core process running core_process._serve, whose steps
  take `--step-ms` and which logs how many requests each step admitted.
- bursts of N concurrent streaming requests (keep-alive raw sockets, all written at once):
  /v1/completions with a 128-token-id prompt, or /v1/chat/completions (direct only);
  `max_tokens` small. Reported per config: server-process CPU (utime + stime from /proc) per
  request, median [min-max] over interleaved rounds, and time to first SSE chunk p50/p99.
- `--tree DIR` serves another checkout's `pagedinfer` (DIR/pagedinfer/engine/...) as the
  "before" config, interleaved with the working tree.
- `--loops asyncio,uvloop` runs each server once per event loop (uvicorn's names; `pagedinfer
  serve` takes auto: uvloop where installed), interleaved; the configs are named by loop.
- `--profile FILE`: cProfile of one server's event-loop thread over the bursts.

Run: .venv/bin/python bench/request_cost.py [--rounds 7] [--bursts 4] [--tree /tmp/before]
     [--loops asyncio,uvloop]
"""

from __future__ import annotations

import os
import sys

# A "before" tree must win over the editable install, in this process and in the spawned core.
_TREE = os.environ.get("REQUEST_COST_TREE")
if _TREE:
    sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
    sys.path.insert(0, _TREE)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

VOCAB = 128256
PROMPT_LEN = 128


# --- fake engines (server side) ----------------------------------------------------------------
def _outputs(request_id: str, num: int):
    from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput, RequestTiming, Usage

    outs = [RequestOutput(request_id, [CompletionDelta(0, f" w{i}", [i])]) for i in range(num - 1)]
    last = CompletionDelta(0, " end", [1], finish_reason=FinishReason.LENGTH)
    timing = RequestTiming(0.01, 0.02, 0.03, 0.05, 100.0)
    return [*outs, RequestOutput(request_id, [last], True, Usage(PROMPT_LEN, num), timing)]


class _DirectEngine:
    """Every output is ready at once: the server's own work is all there is."""

    model_config = SimpleNamespace(vocab_size=VOCAB)
    max_model_len = 1 << 16
    tokenizer = SimpleNamespace(encode_chat=lambda messages, add_generation_prompt: list(range(PROMPT_LEN)))

    async def generate(self, prompt_token_ids, sampling_params, priority, request_id):
        for out in _outputs(request_id, sampling_params.max_tokens):
            yield out

    async def abort(self, request_id: str) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {"num_running": 0.0, "num_waiting": 0.0, "kv_cache_usage": 0.0}


class _DirectHandle:
    engine = _DirectEngine()
    is_ready = is_alive = True
    state = SimpleNamespace(value="serving")
    num_in_flight = 0

    def require_engine(self) -> _DirectEngine:
        return self.engine

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def request_started(self) -> None:
        pass

    def request_finished(self) -> None:
        pass


# --- fake core process (remote) -----------------------------------------------------------------
class _FakeCore:
    """What core_process._serve calls on an EngineCore; each step admits every waiting request
    (logged: how many per step), sleeps `step_s` and gives each running request one token."""

    def __init__(self, step_s: float, log_path: str | None) -> None:
        self.step_s = step_s
        self.log_path = log_path
        self.waiting: list[tuple[str, int, int]] = []
        self.running: dict[str, list[int]] = {}  # id -> [num_out, max_tokens, num_prompt]

    def add_request(self, request_id, prompt_token_ids, params, priority=0, arrival_time=None) -> None:
        self.waiting.append((request_id, params.max_tokens or 16, len(prompt_token_ids)))

    def abort(self, request_id: str) -> list:
        from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput

        self.waiting = [w for w in self.waiting if w[0] != request_id]
        if self.running.pop(request_id, None) is None:
            return []
        return [RequestOutput(request_id, [CompletionDelta(0, finish_reason=FinishReason.ABORT)], True)]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list:
        from pagedinfer.engine.outputs import RequestOutput

        if self.waiting and self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"{len(self.waiting)}\n")
        for request_id, max_tokens, num_prompt in self.waiting:
            self.running[request_id] = [0, max_tokens, num_prompt]
        self.waiting = []
        if self.step_s:
            time.sleep(self.step_s)
        outs = []
        for request_id, state in list(self.running.items()):
            state[0] += 1
            if state[0] < state[1]:
                outs.append(_outputs(request_id, 2)[0])
            else:
                outs.append(_outputs(request_id, state[1])[-1])
                del self.running[request_id]
        return [RequestOutput(o.request_id, o.deltas, o.finished, o.usage, o.timing) for o in outs]

    def stats(self) -> dict[str, float]:
        return {"num_waiting": float(len(self.waiting)), "num_running": float(len(self.running))}

    def add_step_listener(self, callback) -> None:
        pass


def _fake_core_main(conn, step_s: float, log_path: str | None) -> None:
    from pagedinfer.engine.core_process import _serve

    _serve(_FakeCore(step_s, log_path), conn, [])


def _remote_builder(step_s: float, log_path: str | None):
    def build(config, on_phase):
        import multiprocessing

        from pagedinfer.engine.core_process import CoreInfo
        from pagedinfer.engine.remote_core import RemoteBuilt, RemoteCore

        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_fake_core_main, args=(child_conn, step_s, log_path), daemon=True)
        proc.start()
        child_conn.close()
        stats = {"num_waiting": 0.0, "num_running": 0.0}
        info = CoreInfo(SimpleNamespace(vocab_size=VOCAB), None, 1 << 16, VOCAB, 1 << 20, 16, 1024, stats)
        return RemoteBuilt(RemoteCore(proc, conn, info), info.model_config, None, info.max_model_len)

    return build


# --- the server process ------------------------------------------------------------------------
async def _serve_main(args) -> None:
    import uvicorn

    from pagedinfer.engine.async_engine import AsyncEngine
    from pagedinfer.engine.config import EngineConfig, ServerConfig
    from pagedinfer.engine.metrics import ServingMetrics
    from pagedinfer.engine.server.auth import ApiKeyAuth
    from pagedinfer.engine.server.engine_handle import EngineHandle
    from pagedinfer.engine.server.generation import GenerationService
    from pagedinfer.engine.server.http_server import build_app

    config = EngineConfig(served_model_name="llama-8b")
    metrics = ServingMetrics("llama-8b")
    if args.engine == "remote":
        builder = _remote_builder(args.step_ms / 1e3, args.admit_log)
        handle = EngineHandle(config, lambda cfg: AsyncEngine.from_config(cfg, builder))
        handle.start_loading()
    else:
        handle = _DirectHandle()
    metrics.attach_engine(handle.stats, lambda: handle.is_ready)
    app = build_app(GenerationService(handle, metrics), ServerConfig(), ApiKeyAuth(args.api_key))
    cfg = uvicorn.Config(
        app, host="127.0.0.1", port=args.serve, log_level="warning", lifespan="off", timeout_keep_alive=600
    )
    server = uvicorn.Server(cfg)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        await server.serve()
    finally:  # uvicorn re-raises the SIGINT that stopped it
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        if args.engine == "remote":
            await handle.drain_and_shutdown(1.0)


# --- the load ----------------------------------------------------------------------------------
def _body(endpoint: str, max_tokens: int, rng: random.Random) -> bytes:
    common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    common["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        words = " ".join(f"w{rng.randrange(1000)}" for _ in range(PROMPT_LEN // 2))
        return json.dumps({"messages": [{"role": "user", "content": words}], **common}).encode()
    return json.dumps({"prompt": [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)], **common}).encode()


class _Client:
    """N keep-alive connections; `burst` writes one request on each at once."""

    def __init__(self, port: int, endpoint: str, api_key: str | None) -> None:
        self.port = port
        self.path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        self.endpoint = endpoint
        self.auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def burst(self, n: int, max_tokens: int, rng: random.Random) -> list[float]:
        while len(self.conns) < n:
            self.conns.append(await asyncio.open_connection("127.0.0.1", self.port))
        heads = []
        for _ in range(n):
            body = _body(self.endpoint, max_tokens, rng)
            head = f"POST {self.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{self.auth}"
            heads.append(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        t0 = time.perf_counter()
        for (_, writer), data in zip(self.conns, heads, strict=False):
            writer.write(data)
        return await asyncio.gather(*(self._read(r, t0) for r, _ in self.conns[:n]))

    @staticmethod
    async def _read(reader: asyncio.StreamReader, t0: float) -> float:
        seen, first = b"", None
        while not seen.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            data = await reader.read(1 << 16)
            if not data:
                raise RuntimeError(f"stream ended early: {seen[-300:]!r}")
            if first is None and b"data: {" in seen[-16:] + data:
                first = time.perf_counter() - t0
            seen = seen[-64:] + data
        return first

    def close(self) -> None:
        for _, writer in self.conns:
            writer.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _core_pid(pid: int) -> int | None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"multiprocessing.spawn" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    return None


class _Server:
    def __init__(self, label: str, engine: str, tree: str | None, loop: str, args) -> None:
        self.label, self.engine = label, engine
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        argv = [sys.executable, __file__, "--serve", str(self.port), "--engine", engine, "--loop", loop]
        argv += ["--step-ms", str(args.step_ms)]
        if args.api_key:
            argv += ["--api-key", args.api_key]
        self.admit_log = f"/tmp/request_cost_admit_{self.port}.txt" if engine == "remote" else None
        if self.admit_log:
            argv += ["--admit-log", self.admit_log]
        if args.profile and label == args.profile_label:  # e.g. "after/direct"
            argv += ["--profile", args.profile]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("REQUEST_COST_TREE", None)
        if tree:
            env["REQUEST_COST_TREE"] = tree
        self.proc = subprocess.Popen(argv, env=env, cwd="/tmp")
        self.core_pid: int | None = None

    def wait_ready(self) -> None:
        deadline = time.time() + 90
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if self.engine == "direct" or b" 200 " in s.recv(1024):
                        break
            except OSError:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"server {self.label} did not start")
            time.sleep(0.2)
        if self.engine == "remote":
            self.core_pid = _core_pid(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(2)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _round(server: _Server, client: _Client, args, rng: random.Random) -> dict:
    cpu0 = _cpu_seconds(server.proc.pid)
    core0 = _cpu_seconds(server.core_pid) if server.core_pid else 0.0
    ttfc: list[float] = []
    for _ in range(args.bursts):
        ttfc += await client.burst(args.concurrency, args.max_tokens, rng)
    num = args.bursts * args.concurrency
    cpu_us = (_cpu_seconds(server.proc.pid) - cpu0) / num * 1e6
    core_us = ((_cpu_seconds(server.core_pid) - core0) / num * 1e6) if server.core_pid else None
    return {"cpu_us": cpu_us, "core_cpu_us": core_us, "ttfc_ms": [t * 1e3 for t in ttfc]}


async def _run(servers: list[tuple[_Server, str]], args) -> dict[str, list[dict]]:
    rng = random.Random(0)
    clients = [_Client(s.port, endpoint, args.api_key) for s, endpoint in servers]
    results: dict[str, list[dict]] = {f"{s.label}/{e}": [] for s, e in servers}
    for client in clients:  # warm-up: imports, first-call caches, connections
        await client.burst(args.concurrency, args.max_tokens, rng)
    order = list(range(len(servers)))
    for r in range(args.rounds):
        for i in order[r % len(order) :] + order[: r % len(order)]:  # rotated: no config always first
            server, endpoint = servers[i]
            results[f"{server.label}/{endpoint}"].append(await _round(server, clients[i], args, rng))
    for client in clients:
        client.close()
    return results


def _summary(rounds: list[dict]) -> dict:
    cpu = [r["cpu_us"] for r in rounds]
    ttfc = [t for r in rounds for t in r["ttfc_ms"]]
    core = [r["core_cpu_us"] for r in rounds if r["core_cpu_us"] is not None]
    out = {
        "cpu_us_per_request": {"median": statistics.median(cpu), "min": min(cpu), "max": max(cpu)},
        "ttfc_ms": {"p50": _pct(ttfc, 0.5), "p99": _pct(ttfc, 0.99), "max": max(ttfc)},
        "rounds": rounds,
    }
    if core:
        out["core_cpu_us_per_request"] = statistics.median(core)
    return out


def _variants(args) -> list[tuple[str, str | None, str]]:
    """(label, tree, loop) per server; a label names the loop only when several are compared."""
    trees = ([("before", args.tree)] if args.tree else []) + [("after", None)]
    loops = args.loops.split(",")
    out = []
    for tree_label, tree in trees:
        for loop in loops:
            parts = ([tree_label] if args.tree else []) + ([loop] if len(loops) > 1 else [])
            out.append(("-".join(parts) or "after", tree, loop))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--bursts", type=int, default=4, help="bursts per round and config")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=2, help="one streamed token and the final")
    p.add_argument("--step-ms", type=float, default=2.0, help="remote: the fake core's step time")
    p.add_argument("--engines", default="direct,remote")
    p.add_argument("--endpoints", default="completions,chat", help="chat runs on the direct engine only")
    p.add_argument("--tree", default=None, help="DIR holding DIR/pagedinfer/engine: served as 'before'")
    p.add_argument("--loops", default="auto", help="comma-separated: auto, asyncio, uvloop")
    p.add_argument("--api-key", default=None)
    p.add_argument("--profile", default=None, help="cProfile of one server (--profile-label) to FILE")
    p.add_argument("--profile-label", default="after/direct")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine", default="direct", help=argparse.SUPPRESS)
    p.add_argument("--admit-log", default=None, help=argparse.SUPPRESS)
    p.add_argument("--loop", default="auto", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        import uvicorn

        # as serve.event_loop_factory picks it (inlined: a --tree checkout may predate it)
        loop_factory = uvicorn.Config(app=None, loop=args.loop, log_config=None).get_loop_factory()
        with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_serve_main(args))
        return 0
    servers: list[tuple[_Server, str]] = []
    try:
        for engine in args.engines.split(","):
            for label, tree, loop in _variants(args):
                server = _Server(f"{label}/{engine}", engine, tree, loop, args)
                for endpoint in args.endpoints.split(","):
                    if endpoint == "chat" and engine == "remote":
                        continue
                    servers.append((server, endpoint))
        for s in {id(s): s for s, _ in servers}.values():
            s.wait_ready()
        results = asyncio.run(_run(servers, args))
    finally:
        for s in {id(s): s for s, _ in servers}.values():
            s.stop()
    report = {"args": vars(args), "configs": {}}
    for key, rounds in results.items():
        summary = _summary(rounds)
        report["configs"][key] = summary
        c, t = summary["cpu_us_per_request"], summary["ttfc_ms"]
        core = summary.get("core_cpu_us_per_request")
        extra = f", core process {core:.0f} us" if core is not None else ""
        print(
            f"{key:28s} server CPU {c['median']:6.0f} us/request [{c['min']:.0f}-{c['max']:.0f}]{extra}; "
            f"first chunk p50 {t['p50']:.1f} ms, p99 {t['p99']:.1f} ms"
        )
    for s in {id(s): s for s, _ in servers}.values():
        if s.admit_log and Path(s.admit_log).exists():
            counts = [int(x) for x in Path(s.admit_log).read_text().split()]
            report["configs"].setdefault(f"{s.label}/admitted_per_step", counts)
            print(f"{s.label}: requests admitted per step (first 40): {counts[:40]}")
            Path(s.admit_log).unlink()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
