"""One engine core serving N API-server processes (`pagedinfer serve --api-server-count N`, N > 1).

Each API server has a pipe of its own (`start_shared_core` here, remote_core.attach_remote_engine
on the API server's side) carrying core_process's messages. The core (`_SharedCoreLoop`) waits on
every pipe, remembers which pipe added each request id and sends each step's outputs (and a failed
step's request ids) to their owner only; phases, ready and failed go to every pipe. A step message
also carries the core's stats, the step stats and the number of that pipe's requests still
waiting (`RemoteCore` counts only its own); a pipe with nothing new in a step (no outputs, same
waiting count) gets one only every STATS_INTERVAL_S and when the core goes idle, with the step
stats of the steps it skipped (`_Mirror`). A pipe that says stop or breaks has its requests
aborted; the core exits when no pipe is left (or its parent, the launcher, is gone). The same
per-pipe reader and writer threads keep the same no-deadlock property.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.core.scheduler_output import StepStats
from pagedinfer.engine.core_process import (
    AddRequest,
    abort_all,
    admit_request,
    core_info,
    discard_finished,
    error_output,
)
from pagedinfer.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)
# How stale an API server's mirror of the core's stats (/metrics gauges, /debug/engine_stats) may
# get while none of its requests is in a step; its waiting count (admission) is sent on every
# change. Scrapes come seconds apart; sending every step (~100/s on a GPU) to every idle API
# server cost the core a pickle and a send per pipe per step and woke each one's reader thread.
STATS_INTERVAL_S = 0.1


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
    loop.broadcast(("ready", core_info(built)))
    loop.serve(built.core, step_stats)


@dataclass
class _Mirror:
    """What one pipe was last sent, and the step stats it has not been sent yet (its metrics
    count speculative tokens from every step's stats: a skipped step's must come later)."""

    report: tuple[int, int] | None = None  # (adds received, its requests waiting) as last sent
    sent_at: float = 0.0
    step_stats: list[StepStats] = field(default_factory=list)


class _SharedCoreLoop:
    """The core's side of N API servers' pipes: core_process._serve for one pipe, plus who owns what."""

    def __init__(self, conns: list) -> None:
        self.live = list(conns)
        self.owner: dict[str, Any] = {}  # request id -> the pipe that added it
        self.num_adds = dict.fromkeys(conns, 0)  # adds received per pipe (its RemoteCore's count)
        self.rejected: dict[Any, list[RequestOutput]] = {}  # duplicate ids, answered with the next step
        self.in_flight: set[str] = set()
        self.mirrors: defaultdict[Any, _Mirror] = defaultdict(_Mirror)
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
                    discard_finished(outputs, self.in_flight)
                    failure = (f"{type(exc).__name__}: {exc}", abort_all(core, self.in_flight))
            discard_finished(outputs, self.in_flight)
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
        add: AddRequest = msg[1]
        if add.request_id in self.owner:
            error = f"request id {add.request_id!r} is already in flight"
            self.rejected.setdefault(conn, []).append(error_output(add, error))
            return []
        self.owner[add.request_id] = conn
        return admit_request(self.core, add, self.in_flight)

    def _drop(self, conn) -> None:
        """An API server said stop or went away: abort whatever it still owns."""
        if conn not in self.live:
            return
        self.live.remove(conn)
        self.rejected.pop(conn, None)
        self.mirrors.pop(conn, None)
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
        self._send_mirrors(routed, set(failed), step_stats)
        for conn, request_ids in failed.items():
            if conn in self.live:
                self._send(conn, ("step_failed", failure[0], request_ids))

    def _send_mirrors(
        self, routed: dict[Any, list[RequestOutput]], failed: set, step_stats: list[StepStats]
    ) -> None:
        """A step message to each pipe with news (outputs, failed ids, a new add or waiting count),
        else only once its mirror is STATS_INTERVAL_S old or the core goes idle (it then blocks
        until a message comes: the last chance to send the final stats)."""
        num_waiting = dict.fromkeys(self.live, 0)
        for seq in self.core.scheduler.waiting:
            conn = self.owner.get(seq.request_id)
            if conn in num_waiting:
                num_waiting[conn] += 1
        now, is_idle, stats = time.monotonic(), not self.core.has_unfinished(), None
        for conn in list(self.live):
            mirror = self.mirrors[conn]
            mirror.step_stats += step_stats
            report = (self.num_adds[conn], num_waiting[conn])
            is_news = bool(routed[conn]) or conn in failed or report != mirror.report
            if not (is_news or is_idle or now - mirror.sent_at >= STATS_INTERVAL_S):
                continue
            stats = self.core.stats() if stats is None else stats
            msg = ("step", routed[conn], mirror.step_stats, stats, *report)
            mirror.report, mirror.sent_at, mirror.step_stats = report, now, []
            self._send(conn, msg)
