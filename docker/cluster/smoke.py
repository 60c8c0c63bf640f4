"""Smoke test of a running engine: one gRPC Generate and one OpenAI chat completion.

Used by the local-cluster scripts through a `kubectl port-forward`, so both calls retry
until the forward (and the engine) answer or `--timeout` runs out.

    python docker/cluster/smoke.py --http http://127.0.0.1:18000 --grpc 127.0.0.1:15051 --model NAME

PAGEDINFER_API_KEY, when set, is sent as `Authorization: Bearer <key>` on both protocols.
Exit status 0 when both answered with text, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc

from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc


class SmokeError(RuntimeError):
    """The engine did not answer as expected."""


@dataclass(frozen=True)
class Target:
    http_url: str  # e.g. http://127.0.0.1:18000
    grpc_address: str  # e.g. 127.0.0.1:15051
    model: str  # served model name; empty lets the server pick its only model
    api_key: str | None
    timeout_s: float


def grpc_generate(target: Target, prompt: str, max_tokens: int) -> str:
    """Streams one Generate call; returns the generated text."""
    metadata = [("authorization", f"Bearer {target.api_key}")] if target.api_key else []
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        model=target.model,
    )
    with grpc.insecure_channel(target.grpc_address) as channel:
        grpc.channel_ready_future(channel).result(timeout=min(5.0, target.timeout_s))
        stub = pb_grpc.InferenceServiceStub(channel)
        text, finished = [], False
        for response in stub.Generate(request, timeout=target.timeout_s, metadata=metadata):
            for delta in response.deltas:
                if delta.finish_reason == pb.FINISH_REASON_ERROR:
                    raise SmokeError(f"gRPC Generate failed: {delta.error}")
                text.append(delta.text)
            finished = finished or response.finished
    if not finished:
        raise SmokeError("gRPC Generate stream ended without a finished message")
    return "".join(text)


def openai_chat(target: Target, prompt: str, max_tokens: int) -> str:
    """One non-streaming /v1/chat/completions call; returns the assistant's message."""
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    headers = {"Content-Type": "application/json"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    req = urllib.request.Request(
        f"{target.http_url}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(req, timeout=target.timeout_s) as resp:
        reply = json.loads(resp.read())
    try:
        return reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as e:
        raise SmokeError(f"unexpected OpenAI response: {reply}") from e


def with_retries(call, deadline: float, what: str):
    """Retries `call` on connection errors until `deadline` (time.monotonic())."""
    while True:
        try:
            return call()
        except (grpc.RpcError, grpc.FutureTimeoutError, urllib.error.URLError, ConnectionError) as e:
            if isinstance(e, urllib.error.HTTPError) and e.code < 500:
                raise SmokeError(f"{what}: HTTP {e.code} {e.read()[:500]!r}") from e
            if time.monotonic() >= deadline:
                raise SmokeError(f"{what}: no answer before the deadline ({e})") from e
            time.sleep(1.0)


def run(target: Target, prompt: str, max_tokens: int) -> dict[str, str]:
    deadline = time.monotonic() + target.timeout_s
    grpc_text = with_retries(lambda: grpc_generate(target, prompt, max_tokens), deadline, "gRPC Generate")
    http_text = with_retries(lambda: openai_chat(target, prompt, max_tokens), deadline, "OpenAI chat")
    for name, text in (("gRPC", grpc_text), ("OpenAI", http_text)):
        if not text.strip():
            raise SmokeError(f"{name} answer is empty")
    return {"grpc": grpc_text, "openai": http_text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", required=True, help="base URL of the engine's HTTP port")
    parser.add_argument("--grpc", required=True, help="host:port of the engine's gRPC port")
    parser.add_argument("--model", default="", help="served model name")
    parser.add_argument("--prompt", default="What is the capital of France? Answer in one word.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for both calls together")
    args = parser.parse_args(argv)
    api_key = os.environ.get("PAGEDINFER_API_KEY") or None
    target = Target(args.http.rstrip("/"), args.grpc, args.model, api_key, args.timeout)
    try:
        answers = run(target, args.prompt, args.max_tokens)
    except SmokeError as e:
        print(f"smoke: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"smoke: gRPC   -> {answers['grpc']!r}")
    print(f"smoke: OpenAI -> {answers['openai']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
