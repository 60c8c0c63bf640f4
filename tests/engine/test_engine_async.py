"""AsyncEngine: streaming, abort, overload, invalid input, listeners, drain (tiny Llama, CPU)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedinfer.engine.async_engine import AsyncEngine, EngineOverloadedError
from pagedinfer.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def config(folder, **sched) -> EngineConfig:
    return EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_model_len=128, **sched),
        device=DeviceConfig(device="cpu", dtype="float32"),
    )


async def started(folder, **sched) -> AsyncEngine:
    engine = AsyncEngine.from_config(config(folder, **sched))
    assert engine.startup_phase != "ready" or engine.startup_elapsed >= 0
    await engine.wait_ready()
    assert engine.startup_phase == "ready" and engine.max_model_len == 128
    return engine


async def until(predicate, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def collect(engine, ids, params, **kw):
    outs = []
    async for out in engine.generate(prompt_token_ids=ids, sampling_params=params, **kw):
        outs.append(out)
    return outs


async def test_streams_concurrent_requests_and_reports_stats(tiny_llama_dir):
    engine = await started(tiny_llama_dir)
    steps = []
    engine.add_step_listener(steps.append)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = await asyncio.gather(*(collect(engine, [5 + i, 6, 7, 8], params) for i in range(5)))
    for outs in results:
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        tokens = [t for o in outs for d in o.deltas for t in d.token_ids]
        assert len(tokens) == 6 and outs[-1].usage.completion_tokens == 6
        assert outs[-1].deltas[-1].finish_reason is FinishReason.LENGTH
        assert outs[-1].timing.e2e_latency >= outs[-1].timing.time_to_first_token >= 0
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["generation_tokens_total"] == 30
    assert steps and sum(s.num_generation_tokens for s in steps) == 30
    await engine.shutdown(1.0)


async def test_abort_mid_stream_frees_blocks(tiny_llama_dir):
    engine = await started(tiny_llama_dir)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    outs = []
    async for out in engine.generate(prompt_token_ids=[9] * 20, sampling_params=params, request_id="x"):
        outs.append(out)
        if len(outs) == 3:
            await engine.abort("x")
    assert outs[-1].finished and outs[-1].deltas[-1].finish_reason is FinishReason.ABORT
    assert len(outs) < 100
    assert engine.stats()["kv_free_blocks"] == engine.stats()["kv_total_blocks"]
    # A consumer that walks away (breaks out of the stream) aborts its request too.
    async for _ in engine.generate(prompt_token_ids=[9] * 20, sampling_params=params, request_id="y"):
        break
    await until(lambda: engine.stats()["num_running"] == 0)
    await engine.shutdown(1.0)


async def test_invalid_and_overloaded_raise_before_streaming(tiny_llama_dir):
    engine = await started(tiny_llama_dir, max_waiting_requests=1, max_num_seqs=1)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(InvalidRequestError):
        await collect(engine, [], params)
    with pytest.raises(InvalidRequestError):
        await collect(engine, [3] * 200, params)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        async for _ in engine.generate("text needs a tokenizer", sampling_params=params):
            pass
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    tasks = []
    for key in ("num_running", "num_waiting"):  # one runs (max_num_seqs=1), one waits
        tasks.append(asyncio.create_task(collect(engine, [4, 5, 6], long)))
        await until(lambda key=key: engine.stats()[key] == 1)
    with pytest.raises(EngineOverloadedError):
        await collect(engine, [4, 5], params)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.shutdown(1.0)


async def test_shutdown_drains_then_aborts(tiny_llama_dir):
    engine = await started(tiny_llama_dir)
    slow = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    task = asyncio.create_task(collect(engine, [7, 7, 7], slow))
    queued = asyncio.create_task(collect(engine, [8, 8], slow))
    await until(lambda: engine.stats()["num_running"] >= 1)
    await engine.shutdown(0.0)
    assert (await asyncio.wait_for(queued, 10))[-1].deltas[0].finish_reason is FinishReason.ABORT
    outs = await asyncio.wait_for(task, 10)
    assert outs[-1].finished and outs[-1].deltas[-1].finish_reason is FinishReason.ABORT
    assert not engine._thread.is_alive()


async def test_failed_startup_is_reported(tmp_path):
    engine = AsyncEngine.from_config(
        EngineConfig(model=str(tmp_path / "missing"), device=DeviceConfig(device="cpu"))
    )
    with pytest.raises(Exception, match="failed to start"):
        await engine.wait_ready()
    assert engine.startup_phase == "failed" and engine.startup_error


async def test_idle_engine_sleeps_instead_of_spinning(tiny_llama_dir):
    engine = await started(tiny_llama_dir)
    await collect(engine, [4, 5, 6], SamplingParams(max_tokens=2, temperature=0.0))
    cpu_before = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - cpu_before < 0.1  # a spinning step loop would burn ~0.5 s
    await engine.shutdown(1.0)


async def test_lagging_consumer_gets_merged_updates_with_every_token(tiny_llama_dir):
    engine = await started(tiny_llama_dir)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    prompt = [5, 6, 7, 8]
    eager = await collect(engine, prompt, params)  # reads as fast as the engine steps
    lagging, gen = [], engine.generate(prompt_token_ids=prompt, sampling_params=params, request_id="lag")
    lagging.append(await gen.__anext__())
    stream = engine._streams["lag"]  # still in flight: the first update was one token of twelve
    # Everything else piles up unread, up to the final output (num_running reaches 0 inside the
    # step, before that output is posted: waiting on it could see the last update split off).
    await until(lambda: any(getattr(item, "finished", False) for item in stream.items))
    lagging += [out async for out in gen]
    assert len(lagging) == 2 and lagging[-1].finished  # the first update, then one with the rest

    def tokens(outs):
        return [t for o in outs for d in o.deltas for t in d.token_ids]

    assert tokens(lagging) == tokens(eager) and len(tokens(eager)) == 12
    assert [x.sampled.token_id for o in lagging for d in o.deltas for x in d.logprobs] == tokens(eager)
    assert lagging[-1].deltas[-1].finish_reason is FinishReason.LENGTH
    assert lagging[-1].usage.completion_tokens == 12 and lagging[-1].timing is not None
    await engine.shutdown(1.0)
