"""The engine core in its own process (core_process.py, remote_core.py) behind the same AsyncEngine (CPU)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from pagedinfer.engine.async_engine import AsyncEngine
from pagedinfer.engine.config import ServerConfig
from pagedinfer.engine.core_process import AddRequest, CoreInfo, _serve
from pagedinfer.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from pagedinfer.engine.metrics import ServingMetrics
from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput
from pagedinfer.engine.remote_core import CoreStepError, RemoteBuilt, RemoteCore, build_remote_engine
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.server.auth import ApiKeyAuth
from pagedinfer.engine.server.engine_handle import EngineHandle, NotServingError, ServerState
from pagedinfer.engine.server.generation import GenerationService
from pagedinfer.engine.server.http_server import build_app
from tests.engine.test_engine_async import collect, config, until

pytestmark = pytest.mark.timeout(180)


def tokens(outs) -> list[int]:
    return [t for o in outs for d in o.deltas for t in d.token_ids]


async def test_remote_core_matches_in_process_and_aborts_and_stops(tiny_llama_dir):
    local = AsyncEngine.from_config(config(tiny_llama_dir))
    remote = AsyncEngine.from_config(config(tiny_llama_dir), build_remote_engine)
    phases = []
    while remote.startup_phase not in ("ready", "failed"):
        phases.append(remote.startup_phase)
        await asyncio.sleep(0.005)
    await asyncio.gather(local.wait_ready(), remote.wait_ready())
    assert "loading_weights" in phases and remote.max_model_len == local.max_model_len == 128
    assert remote.stats().keys() == local.stats().keys()  # the full set before the first step
    steps = []
    remote.add_step_listener(steps.append)

    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=1, n=2)
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]
    expected = await asyncio.gather(*(collect(local, p, params) for p in prompts))
    got = await asyncio.gather(*(collect(remote, p, params) for p in prompts))
    for want, have in zip(expected, got, strict=True):
        for index in (0, 1):
            assert [t for o in have for d in o.deltas if d.index == index for t in d.token_ids] == [
                t for o in want for d in o.deltas if d.index == index for t in d.token_ids
            ]
        assert have[-1].finished and have[-1].usage.completion_tokens == 14
        assert {d.finish_reason for d in have[-1].deltas} == {FinishReason.LENGTH}
    assert sum(s.num_generation_tokens for s in steps) == 4 * 14
    assert remote.stats()["num_running"] == 0

    with pytest.raises(InvalidRequestError):  # validated in the server process, before streaming
        await collect(remote, [10**6], params)

    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    gen = remote.generate(prompt_token_ids=[9, 9, 9], sampling_params=long)
    first = await gen.__anext__()
    await gen.aclose()  # abort mid-stream: the core frees its blocks
    await until(lambda: remote.stats()["kv_cache_usage"] == 0.0 and remote.stats()["num_running"] == 0)
    assert len(tokens([first])) < 100

    process = remote._built.core._process
    await asyncio.gather(local.shutdown(1.0), remote.shutdown(1.0))
    assert not process.is_alive() and process.exitcode == 0


async def test_dead_core_fails_requests_and_health_and_readiness(tiny_llama_dir):
    """A killed core process (crash, OOM kill): streams and later requests fail, and /ready,
    /health and the death listeners (gRPC health: test_lifecycle) report it, so Kubernetes
    restarts the pod."""
    handle = EngineHandle(
        config(tiny_llama_dir), lambda cfg: AsyncEngine.from_config(cfg, build_remote_engine)
    )
    service = GenerationService(handle, ServingMetrics("tiny"))
    app = build_app(service, ServerConfig(), ApiKeyAuth(None))
    deaths = []
    handle.on_death(lambda: deaths.append(handle.state))
    await handle.start_loading()
    engine = handle.engine
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    assert [(await http.get(p)).status_code for p in ("/ready", "/health")] == [200, 200]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    gen = engine.generate(prompt_token_ids=[5, 6, 7], sampling_params=params)
    await gen.__anext__()
    engine._built.core._process.kill()
    with pytest.raises(EngineDeadError):
        async for _ in gen:
            pass
    with pytest.raises(EngineDeadError):  # later requests too, instead of hanging
        await collect(engine, [5, 6], params)
    await until(lambda: handle.state is ServerState.FAILED)
    assert [(await http.get(p)).status_code for p in ("/ready", "/health")] == [503, 503]
    assert "engine died" in (await http.get("/health")).json()["error"]
    assert deaths == [ServerState.FAILED]
    with pytest.raises(NotServingError, match="engine failed"):
        handle.require_engine()
    await http.aclose()
    await handle.drain_and_shutdown(1.0)


class _DyingCore:
    """A core whose step fails (its process died); `abort`, which the engine calls while failing
    the in-flight streams, holds the engine thread there until the test lets it go."""

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(num_waiting=0)
        self.in_flight: set[str] = set()
        self.failing = threading.Event()
        self.resume = threading.Event()

    def validate(self, prompt_token_ids, params) -> None:
        pass

    def add_request(self, request_id, *args) -> None:
        if self.failing.is_set():
            raise EngineDeadError("the engine core process is gone")
        self.in_flight.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.in_flight)

    def step(self):
        self.in_flight.clear()
        raise EngineDeadError("the engine core process exited (-9)")

    def abort(self, request_id):
        self.failing.set()
        self.resume.wait(10)
        return []

    def stats(self) -> dict[str, float]:
        return {}

    def add_step_listener(self, callback) -> None:
        pass


async def test_request_arriving_while_in_flight_ones_fail_gets_engine_dead():
    """A client retrying at once (woken by its stream's error) registers a stream while the
    engine thread is still failing the others: it must get EngineDeadError too, not wait forever."""
    core = _DyingCore()
    built = SimpleNamespace(core=core, model_config=None, tokenizer=None, max_model_len=128)
    engine = AsyncEngine.from_config(config("unused"), lambda cfg, on_phase: built)
    await engine.wait_ready()
    params = SamplingParams(max_tokens=5)
    first = asyncio.create_task(collect(engine, [1, 2], params, request_id="first"))
    assert await asyncio.to_thread(core.failing.wait, 10)
    retry = asyncio.create_task(collect(engine, [1, 2], params, request_id="retry"))
    await until(lambda: "retry" in engine._streams)
    core.resume.set()
    for task in (first, retry):
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 10)
    await asyncio.wait_for(engine.shutdown(0.5), 10)


# ---- the pipe protocol against a model-free core on a thread -------------------------------------
class _FakeCore:
    """EngineCore's surface without a model: each running request gets token 7 per step until
    its max_tokens; `fail_at` lists steps that raise; `max_running` leaves the rest waiting, and
    adds beyond `max_waiting` waiting are refused, as EngineCore does. It starts stepping once
    it has `min_adds` requests (so a test's first step sees all of them)."""

    def __init__(self, fail_at=(), max_running=1000, delay=0.0, max_waiting=10**6, min_adds=0) -> None:
        self.left: dict[str, int] = {}
        self.fail_at, self.max_running, self.delay = set(fail_at), max_running, delay
        self.max_waiting, self.min_adds = max_waiting, min_adds
        self.num_adds = self.num_steps = 0
        self.aborted: list[str] = []

    def has_unfinished(self) -> bool:
        return bool(self.left) and self.num_adds >= self.min_adds

    def add_request(self, request_id, prompt_token_ids, params, priority, arrival_time) -> None:
        self.num_adds += 1
        if len(self.left) - self.max_running >= self.max_waiting:
            raise EngineOverloadedError("waiting queue full")
        self.left[request_id] = params.max_tokens

    def abort(self, request_id):
        self.aborted.append(request_id)
        if self.left.pop(request_id, None) is None:
            return []
        return [RequestOutput(request_id, [CompletionDelta(0, finish_reason=FinishReason.ABORT)], True)]

    def step(self):
        self.num_steps += 1
        time.sleep(self.delay)
        if self.num_steps in self.fail_at:
            raise RuntimeError("step exploded")
        outputs = []
        for request_id in list(self.left)[: self.max_running]:
            self.left[request_id] -= 1
            done = self.left[request_id] == 0
            if done:
                del self.left[request_id]
            reason = FinishReason.LENGTH if done else None
            outputs.append(
                RequestOutput(request_id, [CompletionDelta(0, " t", [7], finish_reason=reason)], done)
            )
        return outputs

    def stats(self) -> dict[str, float]:
        return {"num_waiting": float(max(len(self.left) - self.max_running, 0))}


class _ThreadProcess:
    """Stands in for the core's process: `_serve` on a thread, its pipe end closed at exit
    (unless `close_pipe` is false: as if a process it started still held it), and a sentinel
    that turns readable when it ends, as a process's does."""

    def __init__(self, core, conn, close_pipe: bool = True) -> None:
        self.exitcode = None
        self.sentinel, self._sentinel_end = os.pipe()
        self._thread = threading.Thread(target=self._main, args=(core, conn, close_pipe), daemon=True)
        self._thread.start()

    def _main(self, core, conn, close_pipe: bool) -> None:
        try:
            _serve(core, conn, [])
            self.exitcode = 0
        except BaseException:
            self.exitcode = 1
            raise
        finally:
            if close_pipe:
                conn.close()
            os.close(self._sentinel_end)

    def join(self, timeout=None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def kill(self) -> None:
        pass


def remote_on_thread(core: _FakeCore, close_pipe: bool = True) -> RemoteCore:
    server_conn, child_conn = multiprocessing.Pipe(duplex=True)
    info = CoreInfo(None, None, 8192, None, 100_000, 4, 8, core.stats())
    return RemoteCore(_ThreadProcess(core, child_conn, close_pipe), server_conn, info)


def test_burst_of_long_prompts_while_the_core_streams_never_deadlocks():
    """The core sends a big step message every few ms while the server sends 200 prompts of
    4,000 tokens without stepping: both sides blocked in send() unless the pipe is drained."""
    core = _FakeCore(delay=0.002)
    remote = remote_on_thread(core)
    params = SamplingParams(max_tokens=10**6)
    for i in range(256):  # 256 streams decoding: ~256 outputs per step message
        remote.add_request(f"busy-{i}", [1], params)
    sender = threading.Thread(
        target=lambda: [remote.add_request(f"new-{i}", list(range(4000)), params) for i in range(200)],
        daemon=True,
    )
    sender.start()
    sender.join(30)
    assert not sender.is_alive() and remote._num_adds_sent == 456
    deadline = time.monotonic() + 30
    while core.num_adds < 456 or len(remote._received) < 2:  # (it may have read them all at once)
        assert time.monotonic() < deadline, f"the core received {core.num_adds} of 456"
        time.sleep(0.01)
    outputs = remote.step()  # every step message waiting, merged: several tokens per request
    assert sum(1 for o in outputs if o.request_id == "busy-0") > 1
    remote.close()
    assert not remote._reader.is_alive() and not remote._process.is_alive()


def test_failed_step_in_core_fails_in_flight_requests_and_keeps_serving():
    core = _FakeCore(fail_at={2}, min_adds=2)  # both in flight when step 2 fails
    remote = remote_on_thread(core)
    remote.add_request("a", [1], SamplingParams(max_tokens=5))
    remote.add_request("b", [1], SamplingParams(max_tokens=5))
    with pytest.raises(CoreStepError, match="step exploded"):
        while True:
            remote.step()
    assert sorted(core.aborted) == ["a", "b"] and not remote.has_unfinished()
    remote.add_request("c", [1], SamplingParams(max_tokens=3))  # the core lives on
    tokens = []
    while remote.has_unfinished():
        tokens += [t for o in remote.step() for d in o.deltas for t in d.token_ids]
    assert tokens == [7, 7, 7] and not remote.is_dead
    remote.close()


async def test_failed_step_in_core_ends_streams_with_error_then_serves_again():
    core = _FakeCore(fail_at={3}, delay=0.01)
    built = RemoteBuilt(remote_on_thread(core), None, None, 8192)
    engine = AsyncEngine.from_config(config("unused"), lambda cfg, on_phase: built)
    await engine.wait_ready()
    with pytest.raises(EngineDeadError, match="step exploded"):
        await collect(engine, [1, 2], SamplingParams(max_tokens=50))
    outs = await collect(engine, [1, 2], SamplingParams(max_tokens=4))
    assert outs[-1].finished and outs[-1].deltas[-1].finish_reason is FinishReason.LENGTH
    assert engine.dead_error is None
    await engine.shutdown(1.0)


def test_num_waiting_counts_adds_the_core_has_not_reported():
    core = _FakeCore(max_running=0)  # everything waits
    remote = remote_on_thread(core)
    for i in range(3):
        remote.add_request(f"r{i}", [1], SamplingParams(max_tokens=5))
        assert remote.scheduler.num_waiting == i + 1  # at once, before any step message
    remote.step()
    assert remote.scheduler.num_waiting == 3
    for i in range(3):
        remote.abort(f"r{i}")
    while remote.has_unfinished():
        remote.step()
    assert remote.scheduler.num_waiting == 0
    remote.close()


async def test_requests_over_the_waiting_limit_are_refused_before_streaming():
    """With the core busy in a long step, adds already sent are not in its last report yet: they
    must still count, so requests over max_waiting_requests raise EngineOverloadedError in
    generate() (HTTP 429) instead of streams the core ends with finish_reason=error."""
    core = _FakeCore(max_running=0, delay=0.2, max_waiting=3)
    built = RemoteBuilt(remote_on_thread(core), None, None, 8192)
    engine = AsyncEngine.from_config(config("unused", max_waiting_requests=3), lambda cfg, on_phase: built)
    await engine.wait_ready()
    tasks = []
    for _ in range(6):  # spaced: each add reaches the pipe before the next request comes
        tasks.append(asyncio.create_task(collect(engine, [1, 2], SamplingParams(max_tokens=5))))
        await asyncio.sleep(0.03)
    await until(lambda: core.num_adds == 3)  # every accepted add reached the core
    await asyncio.sleep(0.5)  # several step messages: any late rejection would have come back
    done = [t for t in tasks if t.done()]
    assert len(done) == 3 and all(isinstance(t.exception(), EngineOverloadedError) for t in done)
    assert core.num_adds == 3
    await engine.shutdown(0.0)
    await asyncio.gather(*tasks, return_exceptions=True)


def _refuse_to_unpickle():
    raise pickle.UnpicklingError("a corrupt message")


class _Unreadable:
    """Pickles fine; unpickling raises, as a corrupt or version-skewed message would."""

    def __reduce__(self):
        return (_refuse_to_unpickle, ())


class _PoisonCore(_FakeCore):
    """From its second step on, its step messages cannot be read on the server side."""

    def stats(self) -> dict:
        stats = super().stats()
        if self.num_steps >= 2:
            stats["poison"] = _Unreadable()
        return stats


async def test_unreadable_message_from_the_core_fails_pending_and_later_requests():
    """The reader thread must not die quietly on a message it cannot read: step() would then
    wait forever. The core counts as gone: streams fail, later requests fail fast."""
    remote = remote_on_thread(_PoisonCore(delay=0.005))
    engine = AsyncEngine.from_config(
        config("unused"), lambda cfg, on_phase: RemoteBuilt(remote, None, None, 8192)
    )
    await engine.wait_ready()
    reasons = []
    engine.add_death_listener(reasons.append)
    params = SamplingParams(max_tokens=50)
    with pytest.raises(EngineDeadError, match="UnpicklingError: a corrupt message"):
        await asyncio.wait_for(collect(engine, [1, 2], params), 10)
    with pytest.raises(EngineDeadError, match="a corrupt message"):  # at once
        await asyncio.wait_for(collect(engine, [1, 2], params), 1)
    await until(lambda: reasons)  # the listeners run after the streams have failed
    assert remote.is_dead and len(reasons) == 1
    with pytest.raises(EngineDeadError):  # RemoteCore itself refuses too
        remote.add_request("late", [1], params)
    await asyncio.wait_for(engine.shutdown(1.0), 30)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the core's end
def test_core_exiting_while_its_pipe_stays_open_is_seen_gone():
    """A process the core started (a compile worker) may keep the pipe open after the core
    exits: the reader must not wait for an end of file that never comes."""
    core = _FakeCore(fail_at={1})
    core.abort = lambda request_id: 1 / 0  # _serve raises after the failed step: the core exits
    remote = remote_on_thread(core, close_pipe=False)
    remote.add_request("a", [1], SamplingParams(max_tokens=5))
    outcome = []
    stepper = threading.Thread(target=lambda: outcome.append(_step_error(remote)), daemon=True)
    stepper.start()
    stepper.join(10)
    assert outcome and isinstance(outcome[0], EngineDeadError), outcome
    assert remote.is_dead and "exited (1)" in str(outcome[0])
    remote.close()


def _step_error(remote: RemoteCore) -> BaseException | None:
    try:
        while remote.has_unfinished():
            remote.step()
    except BaseException as exc:
        return exc
    return None


def test_step_failure_names_only_requests_still_in_flight():
    """A request that ended before the failing step (aborted in the same round) is reported in
    that step's outputs, not among the failure's aborted requests."""
    core = _FakeCore(fail_at={1})
    server_conn, child_conn = multiprocessing.Pipe(duplex=True)
    for msg in (("add", _add("a")), ("add", _add("b")), ("abort", "a")):  # all read before the step
        server_conn.send(msg)
    process = _ThreadProcess(core, child_conn)
    step = server_conn.recv()
    assert step[0] == "step" and [(o.request_id, o.finished) for o in step[1]] == [("a", True)]
    assert server_conn.recv() == ("step_failed", "RuntimeError: step exploded", ["b"])
    server_conn.send(("stop",))
    process.join(10)
    assert process.exitcode == 0


def _add(request_id: str) -> AddRequest:
    return AddRequest(request_id, [1], SamplingParams(max_tokens=5), 0, 0.0)


class _ScriptedProcess:
    """The core's process when the test itself plays the core on `conn`: it ends on join."""

    exitcode = 0

    def __init__(self, conn) -> None:
        self._conn = conn
        self.sentinel, self._sentinel_end = os.pipe()

    def join(self, timeout=None) -> None:
        if not self._conn.closed:
            self._conn.close()
            os.close(self._sentinel_end)

    def is_alive(self) -> bool:
        return not self._conn.closed

    def kill(self) -> None:
        self.join()


def _step_message(request_id: str, num_adds: int) -> tuple:
    out = RequestOutput(request_id, [CompletionDelta(0, " t", [7], finish_reason=FinishReason.LENGTH)], True)
    return ("step", [out], [], {"num_waiting": 0.0}, num_adds)


def test_late_step_failure_of_finished_requests_spares_a_new_request():
    """A step failure naming only requests that have finished here (as a core that counted its
    aborted requests in sends) must not fail a request added since: the failed step never saw it."""
    server_conn, core_conn = multiprocessing.Pipe(duplex=True)
    remote = RemoteCore(
        _ScriptedProcess(core_conn), server_conn, CoreInfo(None, None, 8192, None, 100, 4, 8, {})
    )
    remote.add_request("a", [1], SamplingParams(max_tokens=5))
    core_conn.send(_step_message("a", 1))
    core_conn.send(("step_failed", "RuntimeError: step exploded", ["a"]))
    deadline = time.monotonic() + 10
    while len(remote._received) < 2:  # both read: the failure comes after its step, separately
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [o.request_id for o in remote.step()] == ["a"]
    assert remote.has_unfinished()  # the failure is queued
    remote.add_request("c", [1], SamplingParams(max_tokens=5))
    assert remote.step() == []  # the stale failure, dropped
    core_conn.send(_step_message("c", 2))
    assert [o.request_id for o in remote.step()] == ["c"] and not remote.has_unfinished()
    assert [core_conn.recv()[1].request_id for _ in range(2)] == ["a", "c"]
    remote.close()


class _SlowSendConn:
    """The server's pipe end where each send takes `delay` (the core busy in a step, the pipe full)."""

    def __init__(self, conn, delay: float) -> None:
        self._conn, self._delay = conn, delay

    def send_bytes(self, buf) -> None:
        time.sleep(self._delay)
        self._conn.send_bytes(buf)

    def send(self, obj) -> None:
        time.sleep(self._delay)
        self._conn.send(obj)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_adds_and_aborts_never_wait_for_a_slow_pipe():
    """AsyncEngine calls add_request under the lock generate() and abort() take on the event
    loop: it must queue the message, not wait for the pipe."""
    core = _FakeCore(max_running=0)
    server_conn, child_conn = multiprocessing.Pipe(duplex=True)
    info = CoreInfo(None, None, 8192, None, 100_000, 4, 8, core.stats())
    remote = RemoteCore(_ThreadProcess(core, child_conn), _SlowSendConn(server_conn, 0.3), info)
    started = time.monotonic()
    remote.add_request("a", [1], SamplingParams(max_tokens=5))
    remote.add_request("b", [1], SamplingParams(max_tokens=5))
    remote.abort("a")
    assert time.monotonic() - started < 0.2 and remote.scheduler.num_waiting == 2
    deadline = time.monotonic() + 10
    while not core.aborted:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert core.num_adds == 2 and core.aborted == ["a"] and list(core.left) == ["b"]  # in order
    remote.close()


async def test_request_being_added_counts_as_waiting_once():
    """An add the core already counts but that has not returned yet must not still count as
    admitting too: counted twice, requests under max_waiting_requests would be refused."""
    core = _FakeCore(max_running=0)  # everything waits
    remote = remote_on_thread(core)
    add = remote.add_request

    def lingering_add(*args) -> None:
        add(*args)
        time.sleep(0.2)  # counted by RemoteCore, not yet back in AsyncEngine

    remote.add_request = lingering_add
    built = RemoteBuilt(remote, None, None, 8192)
    engine = AsyncEngine.from_config(config("unused", max_waiting_requests=3), lambda cfg, on_phase: built)
    await engine.wait_ready()
    tasks = []
    for _ in range(3):  # each comes while the one before is still being added
        tasks.append(asyncio.create_task(collect(engine, [1, 2], SamplingParams(max_tokens=5))))
        await asyncio.sleep(0.05)
    assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
    with pytest.raises(EngineOverloadedError):  # the limit still holds
        await collect(engine, [1, 2], SamplingParams(max_tokens=5))
    await until(lambda: core.num_adds == 3)
    await engine.shutdown(0.0)
    await asyncio.gather(*tasks, return_exceptions=True)
