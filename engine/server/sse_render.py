"""Server-sent events of the streaming OpenAI endpoints, rendered from per-stream templates.

A chunk's id, object, created and model never change within a stream, so their JSON is
rendered once; per chunk only the delta text (and logprobs, finish reason, usage and timing
where present) is JSON-encoded. At 8k+ chunks/s in one server process the dict-building plus
`json.dumps` of the whole chunk was the server's largest per-token cost (bench/sse_encode.py).
The output parses to the same JSON as the plain dict rendering (tests/engine/server/test_sse_render.py).
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _quote  # what json.dumps uses: same bytes

from pagedinfer.engine.outputs import CompletionDelta, RequestOutput, RequestTiming, SampleLogprobs, Usage
from pagedinfer.engine.server.generation import finish_reason_value

DONE = "data: [DONE]\n\n"


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def usage_dict(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    out: dict = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_prompt_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_prompt_tokens}
    if usage.draft_tokens:
        # speculative decoding in OpenAI's fields for predicted outputs: draft tokens the model
        # accepted (they are in the completion) and those it rejected
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": usage.accepted_draft_tokens,
            "rejected_prediction_tokens": usage.draft_tokens - usage.accepted_draft_tokens,
        }
    return out


def timing_dict(timing: RequestTiming | None) -> dict[str, float] | None:
    """Per-request timing, attached to every final response (a paged-infer extension)."""
    if timing is None:
        return None
    return {
        "queue_time_seconds": timing.queue_time,
        "time_to_first_token_seconds": timing.time_to_first_token,
        "decode_time_seconds": timing.decode_time,
        "e2e_latency_seconds": timing.e2e_latency,
        "tokens_per_second": timing.tokens_per_second,
    }


def chat_logprobs(items: list[SampleLogprobs] | None) -> dict | None:
    if items is None:
        return None
    content = []
    for lp in items:
        top = [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in lp.top]
        s = lp.sampled
        content.append(
            {"token": s.token, "logprob": s.logprob, "bytes": list(s.token.encode()), "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(items: list[SampleLogprobs] | None, offset: int = 0) -> dict | None:
    if items is None:
        return None
    tokens = [lp.sampled.token for lp in items]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.sampled.logprob for lp in items],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items],
        "text_offset": offsets,
    }


def _finish_json(d: CompletionDelta) -> str:
    """The finish reason, and with finish_reason "error" the engine's message (as "error")."""
    if d.finish_reason is None:
        return "null"
    reason = _quote(finish_reason_value(d.finish_reason))
    return reason if d.error is None else f'{reason},"error":{_quote(d.error)}'


class SseRenderer:
    """One stream's events: `render(out)` gives every event of one engine output as one string
    (one body write: the deltas of n > 1 choices, the usage event and [DONE] travel together)."""

    def __init__(self, rid: str, created: int, model: str, obj: str, include_usage: bool) -> None:
        head = _dumps({"id": rid, "object": obj, "created": created, "model": model})[:-1]
        self._head = f"data: {head},"  # + '"choices":[...]' + tail + "}\n\n"
        self._is_chat = obj == "chat.completion.chunk"
        self._include_usage = include_usage
        self._open_tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
        self._offsets: dict[int, int] = {}  # completions: text_offset per choice
        self._started: set[int] = set()  # chat: choices whose role was sent

    def render(self, out: RequestOutput) -> str:
        tail = self._open_tail if not out.finished else self._final_tail(out)
        choice = self._chat_choice if self._is_chat else self._completion_choice
        events = [f'{self._head}"choices":[{choice(d)}]{tail}' for d in out.deltas]
        if out.finished:
            if self._include_usage:
                usage = _dumps({"usage": usage_dict(out.usage), "timing": timing_dict(out.timing)})
                events.append(f'{self._head}"choices":[],{usage[1:]}\n\n')
            events.append(DONE)
        return "".join(events)

    def _final_tail(self, out: RequestOutput) -> str:
        """The last content chunk carries timing (and usage: null when a usage chunk follows)."""
        usage = ',"usage":null' if self._include_usage else ""
        return f',"timing":{_dumps(timing_dict(out.timing))}{usage}}}\n\n'

    def _completion_choice(self, d: CompletionDelta) -> str:
        if d.logprobs is None:
            logprobs = "null"
        else:
            offset = self._offsets.get(d.index, 0)
            logprobs = _dumps(completion_logprobs(d.logprobs, offset))
            # By the tokens' text, as the whole response counts it: the delta's text may hold
            # back the start of a possible stop string, or release text held back before.
            self._offsets[d.index] = offset + sum(len(lp.sampled.token) for lp in d.logprobs)
        return (
            f'{{"index":{d.index:d},"text":{_quote(d.text)},"logprobs":{logprobs},'
            f'"finish_reason":{_finish_json(d)}}}'
        )

    def _chat_choice(self, d: CompletionDelta) -> str:
        role = ""
        if d.index not in self._started:
            self._started.add(d.index)
            role = ',"role":"assistant"'
        logprobs = "null" if d.logprobs is None else _dumps(chat_logprobs(d.logprobs))
        return (
            f'{{"index":{d.index:d},"delta":{{"content":{_quote(d.text)}{role}}},"logprobs":{logprobs},'
            f'"finish_reason":{_finish_json(d)}}}'
        )
