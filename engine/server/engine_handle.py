"""The servers' view of the engine's lifecycle: background load, readiness, draining.

HTTP comes up first and answers /health, /startup and /metrics while the model loads; the
handle loads the engine in the background and tells every ingress path whether it may take
new requests (`require_engine`) and how far loading got (`startup_report`). An engine whose
core dies while serving (its process crashed or was OOM-killed) turns the handle FAILED, so
readiness and liveness fail and Kubernetes restarts the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pagedinfer.engine.config import EngineConfig

logger = logging.getLogger("pagedinfer.server")

EngineLoader = Callable[[EngineConfig], Any]  # returns an AsyncEngine (or an awaitable of one)


class ServerState(str, enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


class NotServingError(RuntimeError):
    """The server cannot take a new request now (loading, draining or failed): HTTP/gRPC 503."""

    def __init__(self, message: str, retry_after_seconds: int = 5) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


@dataclass(frozen=True)
class StartupReport:
    state: ServerState
    phase: str  # the engine's startup phase ("resolving", "loading_weights", ..., "ready")
    elapsed_seconds: float
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "state": self.state.value,
            "phase": self.phase,
            "elapsed_seconds": round(self.elapsed_seconds, 3),
        }
        if self.error:
            out["error"] = self.error
        return out


def default_loader(config: EngineConfig) -> Any:
    from pagedinfer.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(config)


def engine_process_loader(config: EngineConfig) -> Any:
    """The engine core (model, scheduler, detokenizer) in a process of its own."""
    from pagedinfer.engine.async_engine import AsyncEngine
    from pagedinfer.engine.remote_core import build_remote_engine

    return AsyncEngine.from_config(config, build_remote_engine)


def shared_core_loader(conn) -> EngineLoader:
    """One of several API servers (`--api-server-count`): the engine core that the launcher
    started, reached through this server's pipe end `conn`."""

    def load(config: EngineConfig) -> Any:
        from pagedinfer.engine.async_engine import AsyncEngine
        from pagedinfer.engine.remote_core import attach_remote_engine

        return AsyncEngine.from_config(config, lambda _config, on_phase: attach_remote_engine(conn, on_phase))

    return load


class EngineHandle:
    """Owns one AsyncEngine for the servers of a process."""

    def __init__(self, config: EngineConfig, loader: EngineLoader = default_loader) -> None:
        self.config = config
        self._loader = loader
        self._engine: Any | None = None
        self._state = ServerState.STARTING
        self._error: str | None = None
        self._started_at = time.monotonic()
        self._ready_at: float | None = None
        self._load_task: asyncio.Task | None = None
        self._num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._ready_listeners: list[Callable[[], Awaitable[None] | None]] = []
        self._death_listeners: list[Callable[[], Awaitable[None] | None]] = []
        self._background: set[asyncio.Task] = set()

    # -- lifecycle -------------------------------------------------------------------------
    def start_loading(self) -> asyncio.Task:
        """Begin loading in the background; returns the task (awaiting it is optional)."""
        self._started_at = time.monotonic()
        self._load_task = asyncio.get_running_loop().create_task(self._load(), name="engine-load")
        return self._load_task

    def on_ready(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        self._ready_listeners.append(callback)

    def on_death(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        """Called (on the event loop) when a serving engine dies for good."""
        self._death_listeners.append(callback)

    async def _load(self) -> None:
        try:
            engine = self._loader(self.config)
            if inspect.isawaitable(engine):
                engine = await engine
            self._engine = engine
            await self._wait_engine_ready(engine)
        except Exception as e:  # any load failure becomes a visible FAILED state, never a hang
            self._state = ServerState.FAILED
            self._error = f"{type(e).__name__}: {e}"
            logger.exception("engine failed to load")
            return
        if self._state is ServerState.STARTING:
            self._state = ServerState.SERVING
            self._ready_at = time.monotonic()
            logger.info("engine ready in %.1f s", self._ready_at - self._started_at)
            for callback in self._ready_listeners:
                result = callback()
                if inspect.isawaitable(result):
                    await result
        # After the ready listeners: a death reported meanwhile must have the last word.
        add_death_listener = getattr(self._engine, "add_death_listener", None)
        if add_death_listener is not None:
            loop = asyncio.get_running_loop()

            def from_engine_thread(reason: str) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
                    loop.call_soon_threadsafe(self._on_engine_death, reason)

            add_death_listener(from_engine_thread)

    def _on_engine_death(self, reason: str) -> None:
        if self._state not in (ServerState.STARTING, ServerState.SERVING):
            return  # draining or stopped: shutdown reports it
        self._state = ServerState.FAILED
        self._error = f"engine died: {reason}"
        logger.error("engine died: %s; readiness and liveness now fail", reason)
        for callback in self._death_listeners:
            result = callback()
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _wait_engine_ready(self, engine: Any) -> None:
        # An engine that loads in its own background task reports progress via startup_phase.
        while getattr(engine, "startup_phase", "ready") != "ready":
            if getattr(engine, "startup_phase", None) == "failed":
                raise RuntimeError(getattr(engine, "startup_error", "engine startup failed"))
            await asyncio.sleep(0.05)

    async def drain_and_shutdown(self, timeout_seconds: float) -> bool:
        """Stop taking requests, let in-flight ones finish (bounded), shut the engine down.

        Returns True when every in-flight request finished within the timeout.
        """
        if self._state in (ServerState.STARTING, ServerState.SERVING):
            self._state = ServerState.DRAINING
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_seconds)
            drained = True
        except asyncio.TimeoutError:
            drained = False
            logger.warning("drain timeout: %d requests still in flight", self._num_in_flight)
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self._engine is not None:
            await self._engine.shutdown(0.0 if drained else 1.0)
        self._state = ServerState.STOPPED
        return drained

    # -- queries ---------------------------------------------------------------------------
    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def is_ready(self) -> bool:
        return self._state is ServerState.SERVING

    @property
    def is_alive(self) -> bool:
        """False once loading failed or the engine died: only a restart helps (liveness probe)."""
        return self._state is not ServerState.FAILED

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def engine(self) -> Any | None:
        return self._engine

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def require_engine(self) -> Any:
        """The engine, or NotServingError when new requests must be refused."""
        if self._state is ServerState.SERVING and self._engine is not None:
            return self._engine
        if self._state is ServerState.STARTING:
            raise NotServingError(f"model is loading ({self.startup_report().phase})", retry_after_seconds=5)
        if self._state is ServerState.FAILED and self._ready_at is not None:
            raise NotServingError(f"engine failed: {self._error}", retry_after_seconds=60)
        if self._state is ServerState.FAILED:
            raise NotServingError(f"model failed to load: {self._error}", retry_after_seconds=60)
        raise NotServingError("server is shutting down", retry_after_seconds=1)

    def startup_report(self) -> StartupReport:
        engine = self._engine
        if self._state is ServerState.STARTING:
            phase = getattr(engine, "startup_phase", None) if engine is not None else None
            phase = phase or "loading"
            if phase == "ready":  # the engine is; requests are taken once the server flips (~50 ms)
                phase = "starting_server"
        else:
            phase = "ready" if self._state is not ServerState.FAILED else "failed"
        end = self._ready_at if self._ready_at is not None else time.monotonic()
        return StartupReport(self._state, phase, end - self._started_at, self._error)

    def stats(self) -> dict[str, Any] | None:
        if self._engine is None or self._state is ServerState.STARTING:
            return None
        return self._engine.stats()

    # -- in-flight accounting (drain waits for zero) ---------------------------------------
    def request_started(self) -> None:
        self._num_in_flight += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self._num_in_flight -= 1
        if self._num_in_flight == 0:
            self._idle.set()
