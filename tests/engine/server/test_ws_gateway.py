"""The WebSocket gateway with a `websockets` client, and the demo page in headless Chromium."""

from __future__ import annotations

import json
import shutil

import pytest
import websockets

SERVER_MODEL = "tiny"  # protocol behaviour, not text quality
SERVER_ARGS = ("--allowed-origins", "https://good.example", "--max-ws-message-bytes", "8192")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # scripts/setup.sh --dev installs it


async def _recv(ws) -> dict:
    return json.loads(await ws.recv())


async def _connect(server, **kwargs):
    ws = await websockets.connect(server.ws, **kwargs)
    hello = await _recv(ws)
    assert hello["type"] == "hello" and hello["model"] and hello["max_model_len"] == 1024
    return ws


async def test_two_concurrent_generations_and_a_cancel(server) -> None:
    ws = await _connect(server)
    try:
        await ws.send(
            json.dumps({"type": "generate", "id": "a", "prompt": "Hello", "max_tokens": 6, "temperature": 0})
        )
        await ws.send(
            json.dumps(
                {"type": "generate", "id": "b", "prompt": "Count:", "max_tokens": 990, "ignore_eos": True}
            )
        )
        texts, seen_b, events = {"a": "", "b": ""}, 0, {}
        while "a" not in events or "b" not in events:
            msg = await _recv(ws)
            if msg["type"] == "delta":
                texts[msg["id"]] += "".join(d["text"] for d in msg["deltas"])
                if msg["id"] == "b":
                    seen_b += 1
                    if seen_b == 3:
                        await ws.send(json.dumps({"type": "cancel", "id": "b"}))
            else:
                assert msg["type"] in ("done", "cancelled"), msg
                events[msg["id"]] = msg
        assert events["a"]["type"] == "done" and events["a"]["usage"]["completion_tokens"] <= 6
        assert events["a"]["timing"]["time_to_first_token_seconds"] > 0 and texts["a"]
        assert events["b"]["type"] == "cancelled" and seen_b >= 3
    finally:
        await ws.close()
    server.wait_idle()


async def test_disconnect_mid_generation_frees_kv_blocks(server) -> None:
    ws = await _connect(server)
    await ws.send(
        json.dumps({"type": "generate", "id": "x", "prompt": "Go", "max_tokens": 990, "ignore_eos": True})
    )
    assert (await _recv(ws))["type"] == "delta"
    await ws.close()
    server.wait_idle()


BAD_MESSAGES = [
    ("not json", "{oops", None, "malformed JSON"),
    ("not an object", "[1,2]", None, "JSON object"),
    ("unknown type", json.dumps({"type": "fly", "id": "q"}), "q", "unknown message type"),
    ("missing id", json.dumps({"type": "generate", "prompt": "hi"}), None, "id"),
    (
        "bad temperature",
        json.dumps({"type": "generate", "id": "t", "prompt": "hi", "temperature": 5}),
        "t",
        "temperature",
    ),
    (
        "max_tokens zero",
        json.dumps({"type": "generate", "id": "m", "prompt": "hi", "max_tokens": 0}),
        "m",
        "max_tokens",
    ),
    (
        "two inputs",
        json.dumps({"type": "generate", "id": "p", "prompt": "hi", "prompt_token_ids": [1]}),
        "p",
        "exactly one",
    ),
    (
        "prompt too long",
        json.dumps({"type": "generate", "id": "l", "prompt_token_ids": [17] * 1100}),
        "l",
        None,
    ),
    ("cancel unknown", json.dumps({"type": "cancel", "id": "nobody"}), "nobody", "no running generation"),
    ("oversized", json.dumps({"type": "generate", "id": "big", "prompt": "a" * 9000}), None, "exceeds"),
]


async def test_bad_messages_get_errors_on_the_same_connection(server) -> None:
    ws = await _connect(server)
    try:
        for case, raw, gen_id, needle in BAD_MESSAGES:
            await ws.send(raw)
            msg = await _recv(ws)
            assert msg["type"] == "error" and msg["id"] == gen_id, (case, msg)
            assert needle is None or needle in msg["error"]["message"], (case, msg)
        await ws.send(json.dumps({"type": "ping"}))
        assert (await _recv(ws))["type"] == "pong"  # still alive after all of it
    finally:
        await ws.close()


async def test_origin_allow_list(server) -> None:
    with pytest.raises(websockets.exceptions.InvalidStatus):
        await websockets.connect(server.ws, origin="https://evil.example")
    ws = await _connect(server, origin="https://good.example")
    await ws.close()


def test_demo_page_streams_a_reply_in_chromium(server) -> None:
    from playwright.sync_api import sync_playwright

    args = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]
    args += ["--disable-component-update", "--disable-sync", "--no-first-run"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            page = browser.new_page()
            page.goto(f"{server.http}/")
            page.wait_for_function("document.getElementById('status').textContent === 'ready'", timeout=30000)
            page.fill("#max-tokens", "8")
            page.fill("#temperature", "0")
            page.fill("#prompt", "What is the capital of France?")
            page.click("#send")
            page.wait_for_function("document.querySelector('.msg.assistant .meta') !== null", timeout=120000)
            reply = page.inner_text(".msg.assistant")
            assert len(reply.split("\n")[0].strip()) > 0, reply
            assert page.inner_text("#ttft").endswith("s") and float(page.inner_text("#tps")) > 0
        finally:
            browser.close()


async def test_logprobs_come_with_every_token(server) -> None:
    ws = await _connect(server)
    try:
        msg = {"type": "generate", "id": "lp", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        await ws.send(json.dumps({**msg, "logprobs": 2, "ignore_eos": True}))
        tokens, entries = [], []
        while (event := await _recv(ws))["type"] == "delta":
            for d in event["deltas"]:
                tokens += d["token_ids"]
                entries += d["logprobs"]
        assert event["type"] == "done" and event["usage"]["completion_tokens"] == len(tokens) == 5
        assert len(entries) == 5
        for entry in entries:
            assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
            assert max(t["logprob"] for t in entry["top_logprobs"]) == pytest.approx(
                entry["logprob"]
            )  # greedy
    finally:
        await ws.close()
    server.wait_idle()
