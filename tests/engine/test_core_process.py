"""The engine core in its own process (core_process.py) behind the same AsyncEngine (CPU)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from pagedinfer.engine.async_engine import AsyncEngine
from pagedinfer.engine.core_process import build_remote_engine
from pagedinfer.engine.errors import EngineDeadError
from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.sampling_params import InvalidRequestError, SamplingParams
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


async def test_dead_core_fails_requests_with_engine_dead(tiny_llama_dir):
    engine = AsyncEngine.from_config(config(tiny_llama_dir), build_remote_engine)
    await engine.wait_ready()
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    gen = engine.generate(prompt_token_ids=[5, 6, 7], sampling_params=params)
    await gen.__anext__()
    engine._built.core._process.kill()
    with pytest.raises(EngineDeadError):
        async for _ in gen:
            pass
    with pytest.raises(EngineDeadError):  # later requests too, instead of hanging
        await collect(engine, [5, 6], params)
    await engine.shutdown(0.5)


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
