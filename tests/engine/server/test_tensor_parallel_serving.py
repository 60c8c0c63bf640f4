"""`pagedinfer serve --tensor-parallel-size 2` as a user runs it, through the openai SDK.

A real server process (rank 0: HTTP, gRPC, scheduler, sampler) with one worker process (rank
1) on the tiny random model: greedy completions (several prompts in flight together, n = 2,
streamed) equal the in-process tp = 1 engine's. Then the worker is killed: /health answers
503 and the server exits non-zero on its own (no hang on a collective).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagedinfer.engine.config import DeviceConfig, EngineConfig
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "pagedinfer splits heads:", "ab" * 30]
MAX_TOKENS = 16


def _worker_pids(pid: int) -> list[int]:
    """The tensor-parallel worker processes among `pid`'s descendants."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
        if p != pid and b"pagedinfer.engine.parallel.worker" in Path(f"/proc/{p}/cmdline").read_bytes():
            found.append(p)
    return found


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[str, str]:
    llm = LLM(EngineConfig(model=tiny_model, device=DeviceConfig(device="cpu")))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {p: out.text for p, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}


def test_tp2_server_matches_tp1_then_dies_cleanly_with_its_worker(server_proc_cls, tiny_model, reference):
    server = server_proc_cls(extra_args=("--tensor-parallel-size", "2"), model=tiny_model).start()
    try:
        server.wait_ready()
        (worker,) = _worker_pids(server.proc.pid)
        client = openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id

        def complete(prompt: str) -> list[str]:
            out = client.completions.create(
                model=name,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                n=2,
                extra_body={"ignore_eos": True},
            )
            return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # in flight together
            texts = dict(zip(PROMPTS, pool.map(complete, PROMPTS), strict=True))
        assert all(reference.values())
        assert texts == {p: [t, t] for p, t in reference.items()}
        stream = client.completions.create(
            model=name,
            prompt=PROMPTS[1],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == reference[PROMPTS[1]]

        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline and server.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):  # (not listening any more: the exit below)
                status = httpx.get(f"{server.http}/health", timeout=2).status_code
            if status == 503:
                break
            time.sleep(0.1)
        assert status == 503, server.log()[-3000:]
        code = server.proc.wait(60)
        assert code != 0, server.log()[-3000:]
        assert "exited with code -9" in server.log()
    finally:
        server.stop()


def test_tp2_with_the_engine_in_its_own_process(server_proc_cls, tiny_model, reference):
    """The GPU default (--engine-process): rank 0 is the daemonic engine-core process, which
    starts its worker as a plain subprocess (multiprocessing forbids it children)."""
    args = ("--tensor-parallel-size", "2", "--engine-process")
    server = server_proc_cls(extra_args=args, model=tiny_model).start()
    try:
        server.wait_ready()
        assert len(_worker_pids(server.proc.pid)) == 1
        client = openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        out = client.completions.create(
            model=name,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == reference[PROMPTS[0]]
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
