"""The per-request path of the streaming OpenAI endpoints, in process (no model, no sockets):
the SSE response's disconnect handling, token-id prompt checks, and the hand-off of requests
to a core in another process while it steps (bench/request_cost.py measures their cost)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from types import SimpleNamespace

import pytest

from pagedinfer.engine.async_engine import AsyncEngine
from pagedinfer.engine.config import ServerConfig
from pagedinfer.engine.core_process import CoreInfo
from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.metrics import ServingMetrics
from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from pagedinfer.engine.remote_core import RemoteBuilt, RemoteCore
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.server.auth import ApiKeyAuth
from pagedinfer.engine.server.generation import GenerationRequest, GenerationService, PromptInput
from pagedinfer.engine.server.http_server import build_app
from tests.engine.test_core_process import _ScriptedProcess, _step_message
from tests.engine.test_engine_async import config, started, until

pytestmark = pytest.mark.timeout(60)


class _Engine:
    """Streams `num_ready` outputs at once; a longer request then waits until released."""

    model_config = SimpleNamespace(vocab_size=1000)
    max_model_len = 4096
    tokenizer = None

    def __init__(self, num_ready: int) -> None:
        self.num_ready = num_ready
        self.aborted: list[str] = []
        self.release = asyncio.Event()

    async def generate(self, prompt_token_ids, sampling_params, priority, request_id):
        for i in range(sampling_params.max_tokens):
            if i >= self.num_ready:
                await self.release.wait()
            last = i == sampling_params.max_tokens - 1
            reason = FinishReason.LENGTH if last else None
            delta = CompletionDelta(0, f" w{i}", [i], finish_reason=reason)
            yield RequestOutput(request_id, [delta], last, Usage(3, i + 1) if last else None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class _Handle:
    is_ready = is_alive = True

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.num_in_flight = 0

    def require_engine(self) -> _Engine:
        return self.engine

    def stats(self) -> dict[str, float]:
        return {}

    def request_started(self) -> None:
        self.num_in_flight += 1

    def request_finished(self) -> None:
        self.num_in_flight -= 1


def _app(engine: _Engine):
    service = GenerationService(_Handle(engine), ServingMetrics("m"))
    return build_app(service, ServerConfig(), ApiKeyAuth(None)), service


async def _post(app, path: str, body: dict, disconnect: asyncio.Event) -> list[dict]:
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # as uvicorn serves
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {},
    }
    received = False

    async def receive() -> dict:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": data, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def _events(sent: list[dict]) -> list[str]:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_completes_with_starlette_headers_and_leaves_its_task_uncancelled(path) -> None:
    engine = _Engine(num_ready=3)
    app, _ = _app(engine)
    body = {"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    body |= (
        {"prompt": [1, 2, 3]}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    if path == "/v1/chat/completions":
        engine.tokenizer = SimpleNamespace(encode_chat=lambda messages, add_generation_prompt: [1, 2])
    sent = await _post(app, path, body, asyncio.Event())
    start = sent[0]
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache" and headers[b"x-accel-buffering"] == b"no"
    events = _events(sent)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 3
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 3  # one write per output; the last one ends the body too
    assert [m["more_body"] for m in bodies] == [True, True, False] and bodies[-1]["body"].endswith(
        b"[DONE]\n\n"
    )
    assert asyncio.current_task().cancelling() == 0  # the disconnect watcher cancelled nothing
    assert engine.aborted == []


async def test_client_gone_while_waiting_for_the_next_output_aborts_the_request() -> None:
    engine = _Engine(num_ready=1)
    app, service = _app(engine)
    disconnect = asyncio.Event()
    body = {"prompt": [1, 2, 3], "max_tokens": 50, "stream": True}
    call = asyncio.create_task(_post(app, "/v1/completions", body, disconnect))
    await asyncio.sleep(0.05)
    assert not call.done() and engine.aborted == []  # streaming, waiting for output 2
    disconnect.set()
    sent = await asyncio.wait_for(call, 5)  # ends quietly, as Starlette's StreamingResponse does
    await service.wait_background()
    assert len(engine.aborted) == 1 and service.handle.num_in_flight == 0
    assert len(_events(sent)) == 1 and not call.cancelled()
    assert call.cancelling() == 0


async def test_cancel_from_outside_still_cancels_the_stream() -> None:
    engine = _Engine(num_ready=1)
    app, service = _app(engine)
    call = asyncio.create_task(
        _post(app, "/v1/completions", {"prompt": [1], "max_tokens": 9, "stream": True}, asyncio.Event())
    )
    await asyncio.sleep(0.05)
    call.cancel()  # server shutdown, say: not the client's disconnect, so not swallowed
    with pytest.raises(asyncio.CancelledError):
        await call
    await service.wait_background()
    assert len(engine.aborted) == 1


def test_token_id_prompts_are_checked_in_one_pass_with_the_same_messages() -> None:
    service = GenerationService(_Handle(_Engine(1)), ServingMetrics("m"))
    engine = _Engine(1)
    assert service.prompt_token_ids(engine, PromptInput(token_ids=(5, 0, 999))) == [5, 0, 999]
    assert service.prompt_token_ids(engine, PromptInput(token_ids=(True, 2))) == [1, 2]
    for bad, named in (((1, 1000, 2), 1000), ((3, -1), -1)):
        with pytest.raises(InvalidRequestError, match=rf"token id {named} out of range \[0, 1000\)"):
            service.prompt_token_ids(engine, PromptInput(token_ids=bad))


async def test_request_arriving_while_the_core_steps_reaches_it_before_that_step_ends() -> None:
    """The core starts its next step as soon as it has sent a step message: a request that came
    meanwhile must already be in its pipe, or it waits one step more for its first token."""
    server_conn, core_conn = multiprocessing.Pipe(duplex=True)
    info = CoreInfo(SimpleNamespace(vocab_size=100), None, 8192, 100, 100, 4, 8, {"num_waiting": 0.0})
    remote = RemoteCore(_ScriptedProcess(core_conn), server_conn, info)
    built = RemoteBuilt(remote, info.model_config, None, 8192)
    engine = AsyncEngine.from_config(config("unused"), lambda cfg, on_phase: built)
    await engine.wait_ready()
    params = SamplingParams(max_tokens=1)
    first_a = asyncio.ensure_future(
        engine.generate(prompt_token_ids=[1], sampling_params=params, request_id="a").__anext__()
    )
    assert (await asyncio.to_thread(core_conn.recv))[1].request_id == "a"  # the core steps "a" now
    await asyncio.sleep(0.05)  # the engine thread waits in step() for that step's message
    first_b = asyncio.ensure_future(
        engine.generate(prompt_token_ids=[2], sampling_params=params, request_id="b").__anext__()
    )
    assert await asyncio.to_thread(core_conn.poll, 3.0), "request b waited for the step to end"
    assert core_conn.recv()[1].request_id == "b"
    core_conn.send(_step_message("a", 2))
    core_conn.send(_step_message("b", 2))
    assert (await first_a).finished and (await first_b).finished
    await engine.shutdown(0.0)


async def test_error_mid_stream_is_an_event_then_done_ending_the_body() -> None:
    engine = _Engine(num_ready=1)
    app, _ = _app(engine)

    async def failing(prompt_token_ids, sampling_params, priority, request_id):
        yield RequestOutput(request_id, [CompletionDelta(0, " a", [1])])
        raise RuntimeError("boom")

    engine.generate = failing
    sent = await _post(
        app, "/v1/completions", {"prompt": [1], "max_tokens": 5, "stream": True}, asyncio.Event()
    )
    events = _events(sent)
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert json.loads(events[1])["error"]["message"] == "internal error: RuntimeError: boom"
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert [m["more_body"] for m in bodies] == [True, True, False]


async def test_an_id_already_in_flight_is_refused_without_ending_the_request_that_holds_it(tiny_llama_dir):
    """A second request reusing a running request's id gets InvalidRequestError, and the first
    runs to its end: the refusal must not abort by id (a client could end others' requests)."""
    engine = await started(tiny_llama_dir)
    service = GenerationService(_Handle(engine), ServingMetrics("m"))
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = await service.open(GenerationRequest(PromptInput(token_ids=(5, 6, 7)), long, request_id="dup"))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        await service.open(GenerationRequest(PromptInput(token_ids=(8, 9)), long, request_id="dup"))
    await service.wait_background()
    outs = []
    async for out in first:  # the first output included
        outs.append(out)
    tokens = [t for o in outs for d in o.deltas for t in d.token_ids]
    assert outs[-1].finished and outs[-1].deltas[-1].finish_reason is FinishReason.LENGTH
    assert len(tokens) == 40 and service.handle.num_in_flight == 0
    assert engine.stats()["kv_free_blocks"] == engine.stats()["kv_total_blocks"]
    await engine.shutdown(1.0)


async def test_a_request_cancelled_before_its_first_output_is_aborted(tiny_llama_dir):
    """Cancelled while open() waits for the first output: the engine's generator aborts what it
    admitted, so nothing keeps running or holds KV blocks."""
    engine = await started(tiny_llama_dir)
    service = GenerationService(_Handle(engine), ServingMetrics("m"))
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for delay in (0.0, 0.001, 0.005):
        task = asyncio.create_task(service.open(GenerationRequest(PromptInput(token_ids=(5,) * 60), long)))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            stream = await task  # the first output came first: walk away from the stream instead
            await stream.aclose()
        except asyncio.CancelledError:
            pass
        await service.wait_background()
        await until(lambda: engine.stats()["num_running"] + engine.stats()["num_waiting"] == 0)
        assert engine.stats()["kv_free_blocks"] == engine.stats()["kv_total_blocks"]
        assert service.handle.num_in_flight == 0
    await engine.shutdown(1.0)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "\ud800 hi"}),
        ("/v1/completions", {"prompt": ["\udfff"]}),
        ("/v1/completions", {"prompt": [1, 2], "stop": ["\ud800"]}),
        ("/v1/completions", {"prompt": [1, 2], "model": "\ud800"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "\ud800", "content": "hi"}]}),
    ],
)
async def test_lone_surrogates_get_a_400_json_error(path, body) -> None:
    """JSON's "\\ud800" escapes parse into lone surrogates, which are not text: a 400 naming the
    field, not a 500 from the tokenizer or from encoding the reply."""
    app, _ = _app(_Engine(num_ready=1))
    sent = await _post(app, path, {"max_tokens": 3, **body}, asyncio.Event())
    assert sent[0]["status"] == 400
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert "not valid Unicode" in error["message"] and error["type"] == "invalid_request_error"
