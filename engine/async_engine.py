"""asyncio front of the engine: per-request output streams, abort, drain, stats.

The step loop runs on a dedicated thread (model execution never blocks the event loop) and
sleeps on a condition variable when there is nothing to do. Requests and aborts cross into
it through a locked inbox; each step's outputs go back to the event loop in one
`loop.call_soon_threadsafe` call, and a request's consumer merges whatever piled up since it
last read (`merge_outputs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.core.scheduler_output import StepStats
from pagedinfer.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput, Usage, merge_outputs
from pagedinfer.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineOverloadedError", "EngineDeadError"]

logger = logging.getLogger(__name__)


class _Stream:
    """One request's undelivered outputs on its event loop. The engine thread posts to it in
    batches (`_post`); the consumer takes everything ready at once and merges it, so a lagging
    client gets one message with all its new tokens instead of one per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[RequestOutput | BaseException] = []
        self.waiter: asyncio.Future | None = None

    def push(self, item: RequestOutput | BaseException) -> None:  # on the loop's thread
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list[RequestOutput | BaseException]:
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


def _push_all(batch: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream.push(item)


def _post(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """Hand items to their streams with one call_soon_threadsafe per event loop, not one per
    request: each call takes the GIL and writes the loop's wake-up pipe."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed client loop: nobody is listening any more
            loop.call_soon_threadsafe(_push_all, batch)


@dataclass
class _NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


def _aborted_output(new: _NewRequest) -> RequestOutput:
    deltas = [CompletionDelta(i, finish_reason=FinishReason.ABORT) for i in range(new.params.n)]
    usage = Usage(prompt_tokens=len(new.prompt_token_ids), completion_tokens=0)
    return RequestOutput(new.request_id, deltas, finished=True, usage=usage)


class AsyncEngine:
    """Continuous-batching engine for asyncio servers. Build with `AsyncEngine.from_config`."""

    def __init__(self, config: EngineConfig, builder: Callable | None = None) -> None:
        self.config = config
        self.startup_phase = "resolving"
        self.startup_error: str | None = None
        self._started_at = time.monotonic()
        self._ready_at: float | None = None
        self._builder = builder
        self._built = None
        self._cv = threading.Condition()
        self._inbox: list[_NewRequest] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._num_admitting = 0  # taken from the inbox, not yet added to the core
        self._listeners: list[Callable[[StepStats], None]] = []
        self._death_listeners: list[Callable[[str], None]] = []
        self._core_gone: str | None = None  # a core in another process died (its reader says)
        self.dead_error: str | None = None  # set once the core is gone for good
        self._accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pagedinfer-engine", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig, builder: Callable | None = None) -> AsyncEngine:
        """Start loading on the engine thread and return at once; `startup_phase` tracks progress.
        `builder` defaults to engine_builder.build_engine (in this process);
        remote_core.build_remote_engine runs the core in a process of its own."""
        engine = cls(config, builder)
        engine._thread.start()
        return engine

    # ---- readiness and properties -----------------------------------------------------------
    @property
    def startup_elapsed(self) -> float:
        return (self._ready_at or time.monotonic()) - self._started_at

    @property
    def is_ready(self) -> bool:
        return self.startup_phase == "ready"

    def add_death_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` once, on the engine thread, if the engine dies (its core's process
        is gone, or the engine thread failed): every stream has then failed with
        EngineDeadError and new requests get it at once."""
        with self._cv:
            dead = self.dead_error
            if dead is None:
                self._death_listeners.append(callback)
        if dead is not None:
            callback(dead)

    async def wait_ready(self) -> None:
        while self.startup_phase not in ("ready", "failed"):
            await asyncio.sleep(0.02)
        if self.startup_phase == "failed":
            raise EngineDeadError(f"engine failed to start: {self.startup_error}")

    def _require_built(self):
        if self._built is None:
            raise EngineDeadError(f"engine not ready (phase {self.startup_phase})")
        return self._built

    @property
    def model_config(self):
        return self._require_built().model_config

    @property
    def tokenizer(self):
        return self._require_built().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._require_built().max_model_len

    @property
    def served_model_name(self) -> str:
        return self.config.resolved_served_model_name

    # ---- the engine thread ------------------------------------------------------------------
    def _set_phase(self, phase: str) -> None:
        self.startup_phase = phase
        logger.info("engine startup: %s (%.1f s)", phase, self.startup_elapsed)

    def _run(self) -> None:
        try:
            if self._builder is None:
                from pagedinfer.engine.engine_builder import build_engine

                self._builder = build_engine
            self._built = self._builder(self.config, self._set_phase)
            for callback in self._listeners:
                self._built.core.add_step_listener(callback)
            add_death_listener = getattr(self._built.core, "add_death_listener", None)
            if add_death_listener is not None:  # a core in another process
                add_death_listener(self._on_core_gone)
        except Exception as exc:  # surfaced through startup_phase / startup_error
            logger.exception("engine startup failed")
            self.startup_error = f"{type(exc).__name__}: {exc}"
            self.startup_phase = "failed"
            return
        self._ready_at = time.monotonic()
        self._set_phase("ready")
        try:
            self._loop(self._built.core)
        except BaseException as exc:  # never end silently: clients would wait forever
            logger.exception("engine thread failed")
            self._die(f"engine thread failed: {type(exc).__name__}: {exc}")
        finally:
            close = getattr(self._built.core, "close", None)  # a core in another process
            if close is not None:
                close()

    def _on_core_gone(self, reason: str) -> None:  # on the remote core's reader thread
        with self._cv:
            self._core_gone = reason
            self._cv.notify()

    def _loop(self, core) -> None:
        while True:
            with self._cv:
                while not (
                    self._inbox or self._aborts or self._stop or self._core_gone or core.has_unfinished()
                ):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                stop = self._stop
                self._num_admitting = 0 if stop else len(inbox)
                gone = self._core_gone
            if gone is not None:
                self._die(gone)
                return
            for request_id in aborts:
                self._deliver(core.abort(request_id))
            for new in inbox:
                if stop:  # accepted but never started: it ends like an abort
                    stream = self._streams.pop(new.request_id, None)
                    if stream is not None:
                        _post([(stream, _aborted_output(new))])
                else:
                    self._admit(core, new)
            if stop and not core.has_unfinished():
                return
            if core.has_unfinished():
                self._step(core)
            if self.dead_error is not None:
                return

    def _admit(self, core, new: _NewRequest) -> None:
        try:
            # It leaves _num_admitting as the core's num_waiting counts it, in one step under the
            # lock generate() reads both under: seen twice, requests under the limit get refused.
            # (add_request never blocks: EngineCore only books it, RemoteCore queues the send.)
            with self._cv:
                self._num_admitting -= 1
                core.add_request(
                    new.request_id, new.prompt_token_ids, new.params, new.priority, new.arrival_time
                )
        except (InvalidRequestError, EngineOverloadedError, EngineDeadError) as exc:
            self._fail(new.request_id, exc)

    def _die(self, reason: str) -> None:
        """The core is gone or the engine thread failed: fail every stream, refuse new requests
        from now on and tell the death listeners (EngineHandle turns FAILED)."""
        with self._cv:
            if self.dead_error is not None:
                return
            self.dead_error = reason
            streams, self._streams = self._streams, {}
            self._inbox = []
            listeners, self._death_listeners = self._death_listeners, []
        dead = EngineDeadError(reason)
        _post([(stream, dead) for stream in streams.values()])
        for callback in listeners:
            callback(reason)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            _post([(stream, exc)])

    def _step(self, core) -> None:
        try:
            outputs = core.step()
        except Exception as exc:  # fail the in-flight requests, keep serving new ones
            logger.exception("engine step failed; aborting in-flight requests")
            dead = EngineDeadError(f"engine step failed: {exc}")
            # Take the streams in one swap under the lock: generate() registers new streams from
            # the event loop meanwhile (once _post wakes a failed client, its retry can land here
            # at once), and a stream cleared without its error would wait forever.
            with self._cv:
                streams, self._streams = self._streams, {}
            _post([(stream, dead) for stream in streams.values()])  # first: abort may fail too
            is_aborted = self._abort_quietly(core, streams)
            if isinstance(exc, EngineDeadError):  # the core's process is gone: nothing will recover
                self._die(str(exc))
            elif getattr(core, "step_failure_is_fatal", False):  # tensor parallel: ranks out of step
                self._die(f"{dead}; a tensor-parallel engine cannot go on after a failed step")
            elif not is_aborted:  # the core's state is unknown: stepping it on could do anything
                self._die(f"{dead}; aborting its requests failed too")
            return
        self._deliver(outputs)

    @staticmethod
    def _abort_quietly(core, request_ids) -> bool:
        """Abort after a failed step; False if an abort raised (the core's state is then unknown)."""
        ok = True
        for request_id in request_ids:
            try:
                core.abort(request_id)
            except Exception:
                logger.exception("aborting %s after a failed step failed", request_id)
                ok = False
        return ok

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        ready = []
        for out in outputs:
            stream = (
                self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            )
            if stream is not None:
                ready.append((stream, out))
        _post(ready)

    # ---- public API ---------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams,
        priority: int = 0,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs; the last has `finished=True` (and usage, timing).

        Raises InvalidRequestError or EngineOverloadedError before the first output.
        """
        await self.wait_ready()
        new = self._make_request(prompt, prompt_token_ids, sampling_params, priority, request_id)
        stream = _Stream(asyncio.get_running_loop())
        with self._cv:
            if self.dead_error is not None:
                raise EngineDeadError(self.dead_error)
            if not self._accepting or self._stop:
                raise EngineDeadError("the engine is shutting down")
            num_waiting = self._built.core.scheduler.num_waiting + len(self._inbox) + self._num_admitting
            if num_waiting >= self.config.scheduler.max_waiting_requests:
                raise EngineOverloadedError(
                    f"waiting queue full (max_waiting_requests={self.config.scheduler.max_waiting_requests})"
                )
            if new.request_id in self._streams:
                raise InvalidRequestError(f"request id {new.request_id!r} is already in flight")
            self._streams[new.request_id] = stream
            self._inbox.append(new)
            self._cv.notify()
        self._wake_core()
        finished = False
        try:
            while not finished:
                items = await stream.take()
                outputs = [x for x in items if not isinstance(x, BaseException)]
                if outputs:  # everything ready since the last yield, as one update
                    out = merge_outputs(outputs)
                    finished = out.finished
                    yield out
                errors = [x for x in items if isinstance(x, BaseException)]
                if errors and not finished:
                    raise errors[0]
        finally:
            if not finished:  # client gone or cancelled: free its blocks now
                await self.abort(new.request_id)

    def _make_request(self, prompt, prompt_token_ids, params, priority, request_id) -> _NewRequest:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompt_token_ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(map(int, prompt_token_ids))
        self._built.core.validate(ids, params)
        return _NewRequest(request_id or uuid.uuid4().hex, ids, params, int(priority), time.monotonic())

    async def abort(self, request_id: str) -> None:
        """Finish a request now; its stream ends with FinishReason.ABORT and its blocks are freed."""
        with self._cv:
            queued = [r for r in self._inbox if r.request_id == request_id]
            self._inbox = [r for r in self._inbox if r.request_id != request_id]
            self._aborts.append(request_id)
            self._cv.notify()
            stream = self._streams.pop(request_id, None) if queued else None
        if stream is not None:  # never reached the engine thread: end its stream here
            _post([(stream, _aborted_output(queued[0]))])
        else:
            self._wake_core()

    def _wake_core(self) -> None:
        """A core in another process: the engine thread may be waiting in its step() for the
        core's next message; it must send the inbox now, before the core's next step begins."""
        wake = getattr(self._built.core, "wake", None) if self._built is not None else None
        if wake is not None:
            wake()

    def add_step_listener(self, callback: Callable[[StepStats], None]) -> None:
        self._listeners.append(callback)
        if self._built is not None:
            self._built.core.add_step_listener(callback)

    def stats(self) -> dict[str, float]:
        if self._built is None:
            return {"num_running": 0.0, "num_waiting": 0.0, "kv_cache_usage": 0.0}
        return self._built.core.stats()

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish (bounded), abort the rest, stop the loop."""
        self._accepting = False
        deadline = time.monotonic() + max(drain_timeout, 0.0)
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with self._cv:
            self._aborts.extend(self._streams.keys())
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30.0)
