"""The server side of the engine core process: `RemoteCore`, and the builders that start or
attach to a core (core_process has the pipe messages and the core's loop).

`RemoteCore` offers what AsyncEngine's loop calls on an EngineCore (validate, add_request, abort,
has_unfinished, step, stats, add_step_listener), `close`, and `wake` (AsyncEngine has requests to
send: stop waiting in step()).
A reader thread drains the pipe into a queue all the time, so the core never blocks on a full
pipe while the server is busy sending it a burst of long prompts (both sides blocked in send()
would deadlock); `step()` takes every step message waiting and merges them. A writer thread
sends what add_request and abort queue, so neither blocks on a full pipe: AsyncEngine calls
add_request holding the lock its admission control reads under.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.core.scheduler_output import StepStats
from pagedinfer.engine.core_process import AddRequest, CoreInfo, core_main
from pagedinfer.engine.errors import EngineDeadError
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.request_checks import RequestLimits, check_request
from pagedinfer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class CoreStepError(RuntimeError):
    """A step failed inside the core process; it aborted the in-flight requests and goes on."""


class _SchedulerView:
    """The scheduler numbers AsyncEngine reads: the waiting count of the last step message plus
    the adds sent since that the core had not received then (counted as waiting: an upper bound)."""

    def __init__(self, remote: RemoteCore) -> None:
        self._remote = remote

    @property
    def num_waiting(self) -> int:
        remote = self._remote
        num_seen, num_waiting = remote._waiting_report
        return num_waiting + remote._num_adds_sent - num_seen


@dataclass
class RemoteBuilt:
    """Same fields as engine_builder.BuiltEngine, with the core behind a pipe."""

    core: RemoteCore
    model_config: Any
    tokenizer: Any
    max_model_len: int


class RemoteCore:
    """Server-side stand-in for EngineCore; the real one runs in the child process.

    `is_shared`: the core serves other API servers too (and was started by the launcher): its
    step messages carry this server's waiting count, the stats and step stats of steps that
    brought this server no outputs are taken on the reader thread (nothing else would read them
    while this server is idle), and close() does not wait for the core to exit.
    """

    def __init__(self, process, conn, info: CoreInfo, is_shared: bool = False) -> None:
        self._process = process
        self._conn = conn
        self._is_shared = is_shared
        self.info = info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self._limits = RequestLimits(
            info.max_model_len, info.vocab_size, info.block_size, info.num_blocks, info.max_num_seqs
        )
        self.scheduler = _SchedulerView(self)
        self._in_flight: set[str] = set()
        self._stats = info.stats
        self._listeners: list[Callable[[StepStats], None]] = []
        self._death_listeners: list[Callable[[str], None]] = []
        self._num_adds_sent = 0
        # (adds the core had received, its num_waiting) as of the newest step message; one
        # tuple so a reader on another thread never sees half an update.
        self._waiting_report = (0, int(info.stats.get("num_waiting", 0)))
        self._cv = threading.Condition()
        self._received: deque[tuple] = deque()  # messages from the core, oldest first
        self._gone: str | None = None  # why the core process is gone (None while it runs)
        self._is_woken = False  # wake() was called: step() returns without waiting
        self._closing = False
        self._outbox: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()  # pickled, in order
        self._reader = threading.Thread(target=self._read, name="pagedinfer-core-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="pagedinfer-core-writer", daemon=True)
        self._writer.start()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """EngineCore.validate's checks, from the limits the core reported at startup."""
        check_request(prompt_token_ids, params, self._limits)

    def add_request(self, request_id, prompt_token_ids, params, priority=0, arrival_time=None) -> None:
        if self._gone is not None:
            raise EngineDeadError(self._gone)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        msg = ForkingPickler.dumps(
            ("add", AddRequest(request_id, list(prompt_token_ids), params, priority, arrival))
        )
        self._num_adds_sent += 1  # before the core can have it: num_waiting must never miss it
        self._outbox.put(msg)
        self._in_flight.add(request_id)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Asks the core; the aborted request's final output comes with a later step. A dead core
        is reported by the next step() (has_unfinished stays true until then)."""
        if request_id in self._in_flight:
            self._outbox.put(ForkingPickler.dumps(("abort", request_id)))
        return []

    def has_unfinished(self) -> bool:
        # Messages still queued count too: a step failure reported after its step's outputs
        # must reach AsyncEngine now, not fail the next request that comes along.
        return bool(self._in_flight or self._received)

    @property
    def is_dead(self) -> bool:
        return self._gone is not None

    def add_death_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` once, on the reader thread, when the core process dies."""
        with self._cv:
            gone = self._gone
            if gone is None:
                self._death_listeners.append(callback)
        if gone is not None:
            callback(gone)

    def wake(self) -> None:
        """Make a step() waiting for the core's next message return now, empty if none came:
        AsyncEngine has new requests (or aborts) to send. The core starts its next step the
        moment it has sent a step message, so a request left in AsyncEngine's inbox until that
        message arrives misses the next step: one step more before its first token."""
        with self._cv:
            self._is_woken = True
            self._cv.notify()

    def step(self) -> list[RequestOutput]:
        """Outputs of every step message received since the last call (blocks until one is,
        or until wake())."""
        with self._cv:
            while not self._received and self._gone is None and not self._is_woken:
                self._cv.wait()
            self._is_woken = False
            messages = self._take_steps()
            gone = self._gone
        if not messages:
            if gone is None:  # woken before the core's next message
                return []
            self._in_flight.clear()
            raise EngineDeadError(gone)
        if messages[0][0] == "step_failed":
            _, message, aborted = messages[0]
            if self._in_flight.isdisjoint(aborted):
                # Its requests have all finished here: failing now would hit requests sent since,
                # which the failed step never saw.
                logger.warning("a step failure of no request still in flight, ignored: %s", message)
                return []
            self._in_flight.difference_update(aborted)
            raise CoreStepError(message)
        outputs: list[RequestOutput] = []
        for msg in messages:
            outputs += msg[1]
            if not self._is_shared:  # shared: the reader took them
                self._take_stats(msg)
        for out in outputs:
            if out.finished:
                self._in_flight.discard(out.request_id)
        return outputs

    def _take_stats(self, msg: tuple) -> None:
        self._stats = msg[3]
        for s in msg[2]:
            for callback in self._listeners:
                callback(s)

    def _take_steps(self) -> list[tuple]:
        """The step messages at the head of the queue, or a step failure alone (in order)."""
        if self._received and self._received[0][0] == "step_failed":
            return [self._received.popleft()]
        messages = []
        while self._received and self._received[0][0] == "step":
            messages.append(self._received.popleft())
        return messages

    def _read(self) -> None:
        """The reader thread: everything the core sends goes to the queue at once. However it
        ends, the core counts as gone after: step() must never wait for a message that cannot come."""
        error = None
        try:
            self._receive()
        except BaseException as exc:  # a message that does not unpickle, say: the pipe is useless
            logger.exception("reading from the engine core process failed")
            error = f"reading from the engine core process failed: {type(exc).__name__}: {exc}"
        if not self._closing:
            if error is not None:  # alive, maybe, but unreachable: stop it rather than leave it
                self._process.kill()
            self._process.join(5)  # reap it: its exit code says why
        reason = error or f"the engine core process exited ({self._process.exitcode})"
        with self._cv:
            self._gone = reason
            listeners, self._death_listeners = self._death_listeners, []
            self._cv.notify()
        if not self._closing:
            logger.error("%s", reason)
            for callback in listeners:
                callback(reason)

    def _write(self) -> None:
        """The writer thread: sends what add_request, abort and close queued, in order."""
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(msg)
            except OSError:  # the core is gone: the reader sees the pipe end and says so
                return
            except BaseException:  # unreachable from now on: stop it, and the reader says so
                logger.exception("writing to the engine core process failed")
                self._process.kill()
                return

    def _receive(self) -> None:
        """Queue messages until the pipe ends or the process exits with everything it sent read
        (a process it started may hold the pipe open after it)."""
        sentinel = self._process.sentinel
        waitables = [self._conn] if sentinel is None else [self._conn, sentinel]
        while True:
            ready = wait(waitables)
            if self._conn not in ready:
                return
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "step" and self._is_shared:
                self._waiting_report = (msg[4], msg[5])  # this server's requests only
                self._take_stats(msg)
                if not msg[1]:
                    continue  # a step of other servers' requests: nothing for step() to deliver
            elif msg[0] == "step":
                self._waiting_report = (msg[4], int(msg[3].get("num_waiting", 0)))
            with self._cv:
                self._received.append(msg)
                self._cv.notify()

    def stats(self) -> dict[str, float]:
        return self._stats

    def add_step_listener(self, callback: Callable[[StepStats], None]) -> None:
        self._listeners.append(callback)

    def close(self) -> None:
        """Stop the core process (the AsyncEngine loop has ended: nothing is in flight)."""
        self._closing = True
        self._outbox.put(ForkingPickler.dumps(("stop",)))
        self._outbox.put(None)  # the writer ends after it
        if not self._is_shared:  # a shared core exits once every API server has stopped
            self._process.join(30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        self._writer.join(5)  # sent, or the pipe broke when the core went
        self._reader.join(5)  # the core's end closed: the reader has seen EOF
        self._conn.close()


def build_remote_engine(config: EngineConfig, on_phase: Callable[[str], None]) -> RemoteBuilt:
    """Spawn the core process and wait until it is ready (a builder for AsyncEngine)."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(
        target=core_main, args=(config, child_conn), name="pagedinfer-engine-core", daemon=True
    )
    process.start()
    child_conn.close()
    info = _await_ready(conn, on_phase, lambda: process.exitcode, lambda: process.join(30))
    return _remote_built(RemoteCore(process, conn, info), info)


def attach_remote_engine(conn, on_phase: Callable[[str], None]) -> RemoteBuilt:
    """Wait on `conn` for a core that the launcher started for several API servers."""
    info = _await_ready(conn, on_phase, lambda: "unknown", lambda: None)
    return _remote_built(RemoteCore(_SharedCoreProcess(info.core_pid), conn, info, is_shared=True), info)


def _await_ready(conn, on_phase, exitcode: Callable[[], Any], reap: Callable[[], None]) -> CoreInfo:
    while True:
        try:
            msg = conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"engine core process exited during startup ({exitcode()})") from exc
        if msg[0] == "phase":
            on_phase(msg[1])
        elif msg[0] == "failed":
            reap()
            raise RuntimeError(msg[1])
        else:
            return msg[1]


def _remote_built(core: RemoteCore, info: CoreInfo) -> RemoteBuilt:
    tokenizer = None if info.tokenizer is None else info.tokenizer.build()
    return RemoteBuilt(core, info.model_config, tokenizer, info.max_model_len)


class _SharedCoreProcess:
    """The core as an API server that did not start it sees it: by pid (a pidfd to wait on).
    Its exit code is its parent's to read."""

    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.sentinel: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd here: the pipe's end alone says it is gone
            self.sentinel = None

    def is_alive(self) -> bool:
        if self.sentinel is not None:
            return not wait([self.sentinel], timeout=0)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def join(self, timeout: float | None = None) -> None:
        if self.sentinel is not None:
            wait([self.sentinel], timeout=timeout)

    def kill(self) -> None:
        """Only when its pipe became useless (a message that does not unpickle): as with a core
        of our own, stop it rather than leave it; every API server then reports it dead."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
