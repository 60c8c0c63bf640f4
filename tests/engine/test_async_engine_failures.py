"""AsyncEngine when its core misbehaves: no failure may leave a client waiting forever (CPU, no model)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pagedinfer.engine.async_engine import AsyncEngine
from pagedinfer.engine.errors import EngineDeadError
from pagedinfer.engine.outputs import CompletionDelta, RequestOutput
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.server.engine_handle import EngineHandle, ServerState
from tests.engine.test_engine_async import collect, config, until

pytestmark = pytest.mark.timeout(60)

PARAMS = SamplingParams(max_tokens=100)


class _BrokenCore:
    """A model-free core: each step gives every request one token until `fail` is set, then
    raises; `abort` raises too (the core's state is unknown) and `add_request` raises
    `add_error` when given one."""

    def __init__(self, add_error: BaseException | None = None) -> None:
        self.scheduler = SimpleNamespace(num_waiting=0)
        self.in_flight: set[str] = set()
        self.add_error = add_error
        self.fail = threading.Event()
        self.is_closed = False

    def validate(self, prompt_token_ids, params) -> None:
        pass

    def add_request(self, request_id, *args) -> None:
        if self.add_error is not None:
            raise self.add_error
        self.in_flight.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.005)
        if self.fail.is_set():
            raise RuntimeError("step exploded")
        return [RequestOutput(r, [CompletionDelta(0, " t", [7])], False) for r in self.in_flight]

    def abort(self, request_id):
        raise RuntimeError("abort exploded too")

    def stats(self) -> dict[str, float]:
        return {}

    def add_step_listener(self, callback) -> None:
        pass

    def close(self) -> None:
        self.is_closed = True


def _engine(core) -> AsyncEngine:
    built = SimpleNamespace(core=core, model_config=None, tokenizer=None, max_model_len=128)
    return AsyncEngine.from_config(config("unused"), lambda cfg, on_phase: built)


async def _drain(gen) -> None:
    async for _ in gen:
        pass


async def _fail_a_live_stream(engine, core: _BrokenCore) -> list[str]:
    """Open a stream, then make the core's step fail: the stream ends with the step's error.
    Returns the list the engine's death listener appends its reasons to."""
    reasons: list[str] = []
    engine.add_death_listener(reasons.append)
    gen = engine.generate(prompt_token_ids=[1, 2], sampling_params=PARAMS)
    await asyncio.wait_for(gen.__anext__(), 10)
    core.fail.set()
    with pytest.raises(EngineDeadError, match="step exploded"):
        await asyncio.wait_for(_drain(gen), 10)
    return reasons


async def test_step_and_abort_failing_fail_every_stream_and_turn_the_handle_failed():
    """Failing the streams must not depend on abort working: the open stream gets the step's
    error, the engine dies (the core's state is unknown), and the handle reports it (503s)."""
    core = _BrokenCore()
    handle = EngineHandle(config("unused"), lambda cfg: _engine(core))
    deaths = []
    handle.on_death(lambda: deaths.append(handle.state))
    await handle.start_loading()
    engine = handle.engine
    reasons = await _fail_a_live_stream(engine, core)
    await until(lambda: engine.dead_error is not None, 10)
    with pytest.raises(EngineDeadError, match="aborting its requests failed"):  # at once
        await asyncio.wait_for(collect(engine, [1, 2], PARAMS), 1)
    await until(lambda: handle.state is ServerState.FAILED and reasons, 10)  # listeners: after the streams
    assert deaths == [ServerState.FAILED] and not handle.is_alive and not handle.is_ready
    assert len(reasons) == 1 and "step exploded" in reasons[0]
    await asyncio.wait_for(handle.drain_and_shutdown(1.0), 10)


async def test_unexpected_error_on_the_engine_thread_kills_the_engine_visibly():
    """An error no handler expects (here from add_request) ends the engine thread: streams and
    later requests fail with EngineDeadError and the death listeners fire, instead of a silent
    thread death with every client waiting."""
    core = _BrokenCore(add_error=ValueError("bookkeeping broke"))
    engine = _engine(core)
    await engine.wait_ready()
    reasons = []
    engine.add_death_listener(reasons.append)
    with pytest.raises(EngineDeadError, match="engine thread failed: ValueError: bookkeeping broke"):
        await asyncio.wait_for(collect(engine, [1, 2], PARAMS), 10)
    with pytest.raises(EngineDeadError, match="bookkeeping broke"):  # at once
        await asyncio.wait_for(collect(engine, [1, 2], PARAMS), 1)
    await until(lambda: core.is_closed, 10)
    assert reasons == [engine.dead_error]
    await asyncio.wait_for(engine.shutdown(0.5), 10)


async def test_a_failed_step_of_a_lockstep_core_ends_the_engine():
    """A tensor-parallel core (its workers run each step with it) cannot go on after a failed
    step even where aborting works: the engine dies instead of serving on with ranks out of step."""
    core = _BrokenCore()
    core.abort = lambda request_id: []  # aborting works here
    core.step_failure_is_fatal = True
    engine = _engine(core)
    await engine.wait_ready()
    reasons = await _fail_a_live_stream(engine, core)
    await until(lambda: reasons, 10)
    assert "tensor-parallel engine cannot go on" in reasons[0]
