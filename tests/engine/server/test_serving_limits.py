"""Serving limits with real clients over loopback (issue 46, part 5): a request whose prompt fits
the KV cache but whose prompt + max_tokens does not (400 at admission, or the error in the body
and the stream when it runs out later), bounded HTTP heads (431), the WebSocket Origin check
(same origin by default), and /metrics token counters that count aborted requests too."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import openai
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from pagedinfer.engine.config import ServerConfig
from pagedinfer.engine.server.ws_gateway import WebSocketGateway

SERVER_MODEL = "tiny"  # protocol behaviour, not text quality
# 8 blocks of 16: a KV cache of 128 tokens under a 1024-token context
SERVER_ARGS = ("--num-blocks", "8", "--block-size", "16")
CHAT = [{"role": "user", "content": "Tell me a long story."}]


def test_prompt_plus_max_tokens_beyond_the_kv_cache_is_refused(client, model, server) -> None:
    prompt = "x" * 40
    num_prompt = httpx.post(f"{server.http}/tokenize", json={"prompt": prompt}, timeout=30).json()["count"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=prompt, max_tokens=500)
    num_blocks = int(server.engine_stats()["engine"]["kv_total_blocks"])  # (the pool's, a block held back)
    fit = num_blocks * 16 - num_prompt + 1  # the last token is sampled, never fed: it takes no slot
    assert f"at most {fit} new tokens per sequence fit" in err.value.message
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=fit, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == fit


def test_running_out_of_kv_cache_later_says_so(server, model) -> None:
    """No max_tokens (up to the context, 1024): the sequence outgrows the 128-token cache."""
    body = {"model": model, "messages": CHAT, "ignore_eos": True}
    r = httpx.post(f"{server.http}/v1/chat/completions", json=body, timeout=120)
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "error" and "KV cache" in choice["error"]
    events = []
    with httpx.stream(
        "POST", f"{server.http}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    last = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert last[-1]["finish_reason"] == "error" and "KV cache" in last[-1]["error"]
    server.wait_idle()


def _raw_request(server, head: bytes) -> bytes:
    """Send a request head as raw bytes; the server's whole answer (it closes the connection)."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        # (refused before all of it was read: the answer is already on its way)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    ("headers", "words"),
    [
        (b"X-Big: " + b"a" * (1 << 20) + b"\r\n", b"request headers exceed 65536 bytes"),
        (b"".join(b"X-H%d: v\r\n" % i for i in range(10_000)), b"more than 100 request headers"),
    ],
    ids=["1 MB header", "10,000 headers"],
)
def test_oversized_request_heads_get_431(server, headers, words) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n"
    answer = _raw_request(server, head)
    assert answer.startswith(b"HTTP/1.1 431 ") and words in answer
    assert httpx.get(f"{server.http}/health", headers={f"X-{i}": "v" for i in range(50)}).status_code == 200


async def test_websocket_origin_is_same_origin_by_default(server) -> None:
    same = f"http://127.0.0.1:{server.http_port}"
    async with websockets.connect(server.ws, origin=same) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
    async with websockets.connect(server.ws) as ws:  # no Origin: not a browser
        assert json.loads(await ws.recv())["type"] == "hello"
    with pytest.raises(websockets.exceptions.InvalidStatus):
        async with websockets.connect(server.ws, origin="https://evil.example") as ws:
            await ws.recv()


def test_allowed_origins_star_is_any_origin() -> None:
    gateway = WebSocketGateway(None, ServerConfig(allowed_origins=("*",)), None)
    assert gateway.origin_allowed("https://evil.example", "127.0.0.1:8000")
    default = WebSocketGateway(None, ServerConfig(), None)
    assert not default.origin_allowed("https://evil.example", "127.0.0.1:8000")
    assert default.origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000")


def _token_counters(server) -> tuple[float, float, float]:
    """/metrics' prompt and generation token counters, and the aborted requests."""
    text = httpx.get(f"{server.http}/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    values = {s.name: s.value for s in samples}
    aborted = sum(
        s.value
        for s in samples
        if s.name == "pagedinfer_requests_total" and s.labels["finish_reason"] == "abort"
    )
    return values["pagedinfer_prompt_tokens_total"], values["pagedinfer_generation_tokens_total"], aborted


def test_token_counters_count_aborted_requests(server, model) -> None:
    aborted_before = _token_counters(server)[2]
    body = {"model": model, "prompt": "Count:", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.http}/v1/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        for _ in range(6):  # a few tokens in, the client leaves
            next(lines)
    stats = server.wait_idle()
    prompt, generated, aborted = _token_counters(server)
    assert aborted == aborted_before + 1  # the stream was cut, not finished
    engine = stats["engine"]
    assert generated == engine["generation_tokens_total"] and prompt == engine["prompt_tokens_total"]
    assert generated > 0 and prompt > 0
    time.sleep(0.2)
    assert _token_counters(server) == (prompt, generated, aborted)
