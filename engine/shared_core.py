"""One engine core serving N API-server processes (`pagedinfer serve --api-server-count N`, N > 1).

Each API server has a pipe of its own (`start_shared_core` here, remote_core.attach_remote_engine
on the API server's side) carrying core_process's messages. The core (`_SharedCoreLoop`) waits on
every pipe, remembers which pipe added each request id and sends each step's outputs (and a failed
step's request ids) to their owner only; stats, step stats, phases, ready and failed go to every
pipe, and each step message also carries the number of that pipe's requests still waiting
(`RemoteCore` counts only its own). A pipe that says stop or breaks has its requests aborted; the
core exits when no pipe is left (or its parent, the launcher, is gone). The same per-pipe reader
and writer threads keep the same no-deadlock property.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from multiprocessing.connection import wait
from typing import Any

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.core.scheduler_output import StepStats
from pagedinfer.engine.core_process import (
    _abort_all,
    _Add,
    _admit,
    _core_info,
    _discard_finished,
    _error_output,
)
from pagedinfer.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


def start_shared_core(config: EngineConfig, conns: list) -> multiprocessing.process.BaseProcess:
    """Spawn a core that serves one API server per pipe end in `conns` (the launcher's job)."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    process = ctx.Process(
        target=_shared_core_main, args=(config, conns), name="pagedinfer-engine-core", daemon=True
    )
    process.start()
    return process


def _shared_core_main(config: EngineConfig, conns: list) -> None:
    from pagedinfer.engine.engine_builder import build_engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the launcher stops us
    loop = _SharedCoreLoop(conns)
    try:
        built = build_engine(config, lambda phase: loop.broadcast(("phase", phase)))
    except Exception as exc:  # reported to every API server, which mark startup failed
        logger.exception("engine core startup failed")
        loop.broadcast(("failed", f"{type(exc).__name__}: {exc}"))
        return
    step_stats: list[StepStats] = []
    built.core.add_step_listener(step_stats.append)
    loop.broadcast(("ready", _core_info(built)))
    loop.serve(built.core, step_stats)


class _SharedCoreLoop:
    """The core's side of N API servers' pipes: core_process._serve for one pipe, plus who owns what."""

    def __init__(self, conns: list) -> None:
        self.live = list(conns)
        self.owner: dict[str, Any] = {}  # request id -> the pipe that added it
        self.num_adds = dict.fromkeys(conns, 0)  # adds received per pipe (its RemoteCore's count)
        self.rejected: dict[Any, list[RequestOutput]] = {}  # duplicate ids, answered with the next step
        self.in_flight: set[str] = set()
        self.core = None
        parent = multiprocessing.parent_process()
        self._parent_sentinel = parent.sentinel if parent is not None else None

    def broadcast(self, msg: tuple) -> None:
        for conn in list(self.live):
            self._send(conn, msg)

    def _send(self, conn, msg: tuple) -> None:
        try:
            conn.send(msg)
        except OSError:  # that API server is gone: its requests end here
            self._drop(conn)

    def serve(self, core, step_stats: list[StepStats]) -> None:
        self.core = core
        outputs: list[RequestOutput] = []
        while True:
            outputs += self._receive(bool(outputs))
            if not self.live:
                return
            failure = None
            if core.has_unfinished():
                try:
                    outputs += core.step()
                except Exception as exc:  # as core_process._serve: end the in-flight requests, go on
                    logger.exception("engine step failed; aborting in-flight requests")
                    _discard_finished(outputs, self.in_flight)
                    failure = (f"{type(exc).__name__}: {exc}", _abort_all(core, self.in_flight))
            _discard_finished(outputs, self.in_flight)
            self._send_step(outputs, step_stats[:], failure)
            outputs, step_stats[:] = [], []

    def _receive(self, has_outputs: bool) -> list[RequestOutput]:
        """Handle every message waiting; block only while there is no work (as core_process._serve)."""
        outputs: list[RequestOutput] = []
        waitables = [self._parent_sentinel] if self._parent_sentinel is not None else []
        while self.live:
            is_busy = has_outputs or bool(outputs) or self.core.has_unfinished()
            ready = wait(self.live + waitables, timeout=0 if is_busy else None)
            if not ready:
                break
            if self._parent_sentinel in ready:  # the launcher died: nobody will stop us
                logger.error("the launcher process is gone; the engine core exits")
                self.live.clear()
                break
            for conn in ready:
                outputs += self._handle(conn)
        return outputs

    def _handle(self, conn) -> list[RequestOutput]:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = ("stop",)
        if msg[0] == "stop":
            self._drop(conn)
            return []
        if msg[0] == "abort":  # only the owner may abort: ids are unique per API server, not overall
            return self.core.abort(msg[1]) if self.owner.get(msg[1]) is conn else []
        self.num_adds[conn] += 1
        add: _Add = msg[1]
        if add.request_id in self.owner:
            error = f"request id {add.request_id!r} is already in flight"
            self.rejected.setdefault(conn, []).append(_error_output(add, error))
            return []
        self.owner[add.request_id] = conn
        return _admit(self.core, add, self.in_flight)

    def _drop(self, conn) -> None:
        """An API server said stop or went away: abort whatever it still owns."""
        if conn not in self.live:
            return
        self.live.remove(conn)
        self.rejected.pop(conn, None)
        conn.close()  # its RemoteCore's reader sees the pipe end
        owned = [request_id for request_id, owner in self.owner.items() if owner is conn]
        for request_id in owned:
            del self.owner[request_id]
            self.in_flight.discard(request_id)
            if self.core is not None:
                self.core.abort(request_id)  # its final output has nobody to go to
        if owned:
            logger.warning("an API server left with %d requests in flight: aborted", len(owned))

    def _send_step(self, outputs: list[RequestOutput], step_stats: list[StepStats], failure) -> None:
        failed: dict[Any, list[str]] = {}
        if failure is not None:
            for request_id in failure[1]:
                failed.setdefault(self.owner.pop(request_id, None), []).append(request_id)
        routed = {conn: self.rejected.pop(conn, []) for conn in self.live}
        for out in outputs:
            conn = self.owner.pop(out.request_id, None) if out.finished else self.owner.get(out.request_id)
            if conn in routed:
                routed[conn].append(out)
        num_waiting = dict.fromkeys(self.live, 0)
        for seq in self.core.scheduler.waiting:
            conn = self.owner.get(seq.request_id)
            if conn in num_waiting:
                num_waiting[conn] += 1
        stats = self.core.stats()
        for conn in list(self.live):
            self._send(
                conn, ("step", routed[conn], step_stats, stats, self.num_adds[conn], num_waiting[conn])
            )
        for conn, request_ids in failed.items():
            if conn in self.live:
                self._send(conn, ("step_failed", failure[0], request_ids))
