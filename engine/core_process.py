"""The engine core in a process of its own (`pagedinfer serve --engine-process`), vLLM V1 style.

The server process keeps the asyncio front (AsyncEngine: streams, aborts, merging) and a copy of
the tokenizer for prompts and chat templates; the core process owns the model, the scheduler and
the detokenizer and runs its step loop on its own GIL, so encoding responses for many streams
never delays a step. One duplex pipe (pickled messages) joins them:

    server -> core   ("add", _Add) | ("abort", request_id) | ("stop",)
    core -> server   ("phase", name) | ("ready", CoreInfo) | ("failed", message)
                     ("step", outputs, [StepStats], stats dict, number of adds received)
                     ("step_failed", message, aborted request ids)

`RemoteCore` is the server side: it offers what AsyncEngine's loop calls on an EngineCore
(validate, add_request, abort, has_unfinished, step, stats, add_step_listener), `close`, and
`wake` (AsyncEngine has requests to send: stop waiting in step()).
A reader thread drains the pipe into a queue all the time, so the core never blocks on a full
pipe while the server is busy sending it a burst of long prompts (both sides blocked in send()
would deadlock); `step()` takes every step message waiting and merges them. A writer thread
sends what add_request and abort queue, so neither blocks on a full pipe: AsyncEngine calls
add_request holding the lock its admission control reads under.

`pagedinfer serve --api-server-count N` (N > 1): one core serves N API-server processes, each on
a pipe of its own (`start_shared_core`, `attach_remote_engine`). The core (`_SharedCoreLoop`)
waits on every pipe, remembers which pipe added each request id and sends each step's outputs
(and a failed step's request ids) to their owner only; stats, step stats, phases, ready and
failed go to every pipe, and each step message also carries the number of that pipe's requests
still waiting (`RemoteCore` counts only its own). A pipe that says stop or breaks has its
requests aborted; the core exits when no pipe is left (or its parent, the launcher, is gone).
The same per-pipe reader and writer threads keep the same no-deadlock property.
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
from pagedinfer.engine.errors import EngineDeadError, EngineOverloadedError
from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from pagedinfer.engine.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreInfo:
    """What the server side needs to validate requests and describe the model."""

    model_config: Any
    tokenizer: _TokenizerRecipe | None
    max_model_len: int
    vocab_size: int | None
    num_blocks: int
    block_size: int
    max_num_seqs: int
    stats: dict[str, float]  # core.stats() at startup (until the first step message)
    core_pid: int = 0  # API servers that did not start the core watch it by pid


@dataclass(frozen=True)
class _TokenizerRecipe:
    """A Tokenizer's constructor arguments: the compiled chat template inside it does not pickle
    (a Tokenizer.__reduce__ would make this unnecessary)."""

    backend: Any
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    stop_token_ids: tuple[int, ...]
    special_tokens: dict[str, str]

    @classmethod
    def of(cls, tok) -> _TokenizerRecipe | None:
        if tok is None:
            return None
        special = {k: v for k, v in tok._special_tokens.items() if k not in ("bos_token", "eos_token")}
        return cls(tok.backend, tok.bos_token, tok.eos_token, tok.chat_template, tok.stop_token_ids, special)

    def build(self):
        from pagedinfer.engine.tokenizer import Tokenizer

        return Tokenizer(
            self.backend,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            chat_template=self.chat_template,
            extra_stop_token_ids=self.stop_token_ids,
            special_tokens=self.special_tokens,
        )


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


# ---- the core process -------------------------------------------------------------------------
def _core_main(config: EngineConfig, conn) -> None:
    """Entry point of the spawned process: build, then step whenever there is work."""
    from pagedinfer.engine.engine_builder import build_engine

    try:
        built = build_engine(config, lambda phase: conn.send(("phase", phase)))
    except Exception as exc:  # reported to the server, which marks startup failed
        logger.exception("engine core startup failed")
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    core = built.core
    step_stats: list[StepStats] = []
    core.add_step_listener(step_stats.append)
    conn.send(("ready", _core_info(built)))
    _serve(core, conn, step_stats)


def _core_info(built) -> CoreInfo:
    core = built.core
    kv = core.scheduler.kv
    return CoreInfo(
        built.model_config,
        _TokenizerRecipe.of(built.tokenizer),
        built.max_model_len,
        core.vocab_size,
        kv.num_blocks,
        kv.block_size,
        core.scheduler.config.max_num_seqs,
        core.stats(),
        os.getpid(),
    )


def _serve(core, conn, step_stats: list[StepStats]) -> None:
    outputs: list[RequestOutput] = []
    in_flight: set[str] = set()  # admitted, not yet finished: what a failed step must end
    num_adds = 0  # adds received so far: the server counts the rest as waiting
    while True:
        while conn.poll(0) or not (core.has_unfinished() or outputs):  # block only when idle
            msg = conn.recv()
            if msg[0] == "stop":
                return
            if msg[0] == "abort":
                outputs += core.abort(msg[1])
            else:
                num_adds += 1
                outputs += _admit(core, msg[1], in_flight)
        failure = None
        if core.has_unfinished():
            try:
                outputs += core.step()
            except Exception as exc:  # like AsyncEngine in process: end the in-flight requests, go on
                logger.exception("engine step failed; aborting in-flight requests")
                _discard_finished(outputs, in_flight)  # ended before the step (aborts): not failed
                failure = ("step_failed", f"{type(exc).__name__}: {exc}", _abort_all(core, in_flight))
        _discard_finished(outputs, in_flight)
        conn.send(("step", outputs, step_stats[:], core.stats(), num_adds))
        if failure is not None:
            conn.send(failure)
        outputs, step_stats[:] = [], []


def _discard_finished(outputs: list[RequestOutput], in_flight: set[str]) -> None:
    for out in outputs:
        if out.finished:
            in_flight.discard(out.request_id)


def _abort_all(core, in_flight: set[str]) -> list[str]:
    """Abort every in-flight request after a failed step (their streams get the error instead)."""
    request_ids = sorted(in_flight)
    for request_id in request_ids:
        core.abort(request_id)  # raising here ends the process: the server then sees it dead
    in_flight.clear()
    return request_ids


def _admit(core, add: _Add, in_flight: set[str]) -> list[RequestOutput]:
    """Add a request; a late rejection (the server validated with the same limits and counts
    unreported adds as waiting, so this should not happen) ends its stream with an error finish."""
    try:
        core.add_request(add.request_id, add.prompt_token_ids, add.params, add.priority, add.arrival_time)
        in_flight.add(add.request_id)
        return []
    except (InvalidRequestError, EngineOverloadedError) as exc:
        return [_error_output(add, str(exc))]


def _error_output(add: _Add, message: str) -> RequestOutput:
    deltas = [
        CompletionDelta(i, finish_reason=FinishReason.ERROR, error=message) for i in range(add.params.n)
    ]
    usage = Usage(prompt_tokens=len(add.prompt_token_ids), completion_tokens=0)
    return RequestOutput(add.request_id, deltas, finished=True, usage=usage)


# ---- one core, several API servers ------------------------------------------------------------
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
    """The core's side of N API servers' pipes: `_serve` for one pipe, plus who owns what."""

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
                except Exception as exc:  # as _serve: end the in-flight requests, go on
                    logger.exception("engine step failed; aborting in-flight requests")
                    _discard_finished(outputs, self.in_flight)
                    failure = (f"{type(exc).__name__}: {exc}", _abort_all(core, self.in_flight))
            _discard_finished(outputs, self.in_flight)
            self._send_step(outputs, step_stats[:], failure)
            outputs, step_stats[:] = [], []

    def _receive(self, has_outputs: bool) -> list[RequestOutput]:
        """Handle every message waiting; block only while there is no work (as `_serve`)."""
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


# ---- the server side --------------------------------------------------------------------------
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
        num, info = len(prompt_token_ids), self.info
        if num == 0:
            raise InvalidRequestError("the prompt is empty")
        if num >= info.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num} tokens; this model's context is {info.max_model_len} "
                f"(prompt + at least one output token must fit)"
            )
        vocab_size = info.vocab_size
        if vocab_size is not None and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
            raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab_size})")
        blocks = -(-(num + 1) // info.block_size)
        if blocks > info.num_blocks:
            raise InvalidRequestError(f"the prompt needs {blocks} KV blocks; the cache has {info.num_blocks}")
        if params.n > info.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={info.max_num_seqs}")

    def add_request(self, request_id, prompt_token_ids, params, priority=0, arrival_time=None) -> None:
        if self._gone is not None:
            raise EngineDeadError(self._gone)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        msg = ForkingPickler.dumps(
            ("add", _Add(request_id, list(prompt_token_ids), params, priority, arrival))
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
        target=_core_main, args=(config, child_conn), name="pagedinfer-engine-core", daemon=True
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
