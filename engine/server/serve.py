"""`pagedinfer serve`: one process, HTTP (OpenAI API, WebSocket, page, probes, metrics) + gRPC.

Order of events: HTTP and gRPC bind first (probes answer, /startup shows the loading phase,
gRPC health says NOT_SERVING), the engine loads in the background, then everything turns
ready. SIGTERM/SIGINT: readiness goes false, new requests get 503 / UNAVAILABLE, in-flight
requests finish (bounded by --drain-timeout), the servers stop, the process exits 0.
With --api-server-count N > 1, N of these run as API-server processes under a launcher
(api_servers.py): HTTP on a socket the launcher bound, gRPC on the port it reserved (SO_REUSEPORT),
multiprocess metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn

from pagedinfer.engine.config import SERVER_LOG_FORMAT, EngineConfig, ServerConfig
from pagedinfer.engine.metrics import ServingMetrics
from pagedinfer.engine.server.auth import ApiKeyAuth
from pagedinfer.engine.server.engine_handle import EngineHandle, EngineLoader, default_loader
from pagedinfer.engine.server.generation import GenerationService
from pagedinfer.engine.server.grpc_server import GrpcServer
from pagedinfer.engine.server.http_limits import limited_http_protocol
from pagedinfer.engine.server.http_server import build_app

logger = logging.getLogger("pagedinfer.server")


def describe_urls(config: ServerConfig, http_port: int, grpc_port: int) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    http = f"http://{host}:{http_port}"
    return (
        f"serving: openai={http}/v1 page={http}/ ws=ws://{host}:{http_port}/v1/ws metrics={http}/metrics "
        f"health={http}/health ready={http}/ready startup={http}/startup grpc={host}:{grpc_port} "
        f"(bound to {config.host or '0.0.0.0'})"
    )


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `serve` owns SIGTERM and drains first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class ServerProcess:
    """Everything one `pagedinfer serve` runs; `run()` returns when it has shut down."""

    engine_config: EngineConfig
    server_config: ServerConfig
    loader: EngineLoader = default_loader
    # One of several API servers (--api-server-count): HTTP on the launcher's socket, gRPC
    # joining the port it reserved, multiprocess metrics, SIGINT left to the launcher.
    api_server_index: int | None = None
    sockets: list[socket.socket] | None = None

    def __post_init__(self) -> None:
        name = self.engine_config.resolved_served_model_name
        self.handle = EngineHandle(self.engine_config, self.loader)
        self.metrics = ServingMetrics(
            name,
            enable_vllm_metrics=self.server_config.enable_vllm_metrics,
            api_server_index=self.api_server_index,
        )
        self.metrics.attach_engine(self.handle.stats, lambda: self.handle.is_ready)
        self.service = GenerationService(self.handle, self.metrics)
        auth = ApiKeyAuth(self.server_config.api_key)
        self.app = build_app(self.service, self.server_config, auth)
        self.grpc = GrpcServer(
            self.service, self.server_config, auth, is_reuse_port=self.api_server_index is not None
        )
        self.stop_requested = asyncio.Event()

    def _uvicorn(self) -> _Uvicorn:
        cfg = self.server_config
        config = uvicorn.Config(
            self.app,
            host=cfg.host,
            port=cfg.http_port,
            ws_max_size=max(cfg.max_ws_message_bytes * 2, 1 << 16),  # we answer oversize frames ourselves
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
            http=limited_http_protocol(cfg.max_header_bytes, cfg.max_header_count),
        )
        return _Uvicorn(config)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if self.api_server_index is None else (signal.SIGTERM,)
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        http = self._uvicorn()
        http_task = loop.create_task(http.serve(sockets=self.sockets), name="http")
        while not http.started and not http_task.done():
            await asyncio.sleep(0.02)
        if http_task.done():
            http_task.result()  # bind failure: raise it
            return 1
        await self.grpc.start()
        self.handle.on_ready(lambda: self.grpc.set_serving(True))
        self.handle.on_ready(lambda: self.handle.engine.add_step_listener(self.metrics.on_step))
        self._log_serving(loop)
        self.handle.start_loading()
        progress = loop.create_task(self._log_progress())
        await self.stop_requested.wait()
        progress.cancel()
        await self.shutdown(http, http_task)
        return 0

    def _log_serving(self, loop: asyncio.AbstractEventLoop) -> None:
        http_port = self.server_config.http_port if not self.sockets else self.sockets[0].getsockname()[1]
        if self.api_server_index in (None, 0):  # once: every API server serves the same ports
            logger.info(describe_urls(self.server_config, http_port, self.grpc.port))
        if self.api_server_index is not None:
            index, pid, grpc_port = self.api_server_index, os.getpid(), self.grpc.port
            logger.info(
                "API server %d (pid %d) accepts on ports %d, %d (gRPC)", index, pid, http_port, grpc_port
            )
        logger.info("event loop: %s.%s", type(loop).__module__, type(loop).__name__)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop_requested.is_set():  # a second signal: stop waiting for the drain
            logger.warning("%s again: exiting without draining", sig.name)
            os._exit(1)
        self.stop_requested.set()

    async def shutdown(self, http: _Uvicorn, http_task: asyncio.Task) -> None:
        logger.info("shutting down: draining %d in-flight requests", self.handle.num_in_flight)
        await self.grpc.set_serving(False)
        drained = await self.handle.drain_and_shutdown(self.server_config.drain_timeout_seconds)
        await self.service.wait_background()
        await self.grpc.stop(grace_seconds=1.0)
        http.should_exit = True
        await http_task
        logger.info("shut down (%s)", "drained" if drained else "drain timed out")

    async def _log_progress(self) -> None:
        last = None
        while True:
            report = self.handle.startup_report()
            if report.phase != last:
                logger.info("startup: %s (%.1f s)", report.phase, report.elapsed_seconds)
                last = report.phase
            if report.phase in ("ready", "failed"):
                return
            await asyncio.sleep(0.25)


def event_loop_factory(name: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvicorn's own loop choice: "auto" is uvloop where it imports (as `uvicorn[standard]`
    serves), else asyncio's. Chosen before any loop exists because HTTP, grpc.aio and the engine
    handle share the one loop. uvloop: ~20-40 us less server CPU per streamed request
    (bench/NOTES.md, Round 5). `name` other than "auto" is for tests and bench/request_cost.py."""
    try:  # log_config=None: this Config only picks the loop, it must not reconfigure logging
        return uvicorn.Config(app=None, loop=name, log_config=None).get_loop_factory()
    except ModuleNotFoundError as exc:  # "uvloop" where it is not installed
        raise SystemExit(f"event loop {name}: {exc}") from exc


def run_server(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    loader: EngineLoader = default_loader,
) -> int:
    logging.basicConfig(level=logging.INFO, format=SERVER_LOG_FORMAT)
    loop_factory = event_loop_factory()

    async def main() -> int:  # the gRPC server and events bind to the loop the runner makes
        return await ServerProcess(engine_config, server_config, loader).run()

    with asyncio.Runner(loop_factory=loop_factory) as runner:  # asyncio.run(loop_factory=) is 3.12+
        return runner.run(main())
