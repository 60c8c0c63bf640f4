"""Server-sent events of a streamed chat completion with tools, in OpenAI's shape: a call's
first delta carries its index, id, type and function name with empty arguments, later deltas
carry argument fragments; the choice ends with finish_reason "tool_calls" (a named function:
"stop", as OpenAI).

A named function's arguments stream as they are generated (the output is the arguments object).
With `required` the output (a JSON array of calls) is held until complete; with `auto` content
streams until the model's call marker (e.g. `<tool_call>`) may begin, and what follows is held
and parsed when the choice finishes (held text that is no call goes out as content).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedinfer.engine.outputs import CompletionDelta, RequestOutput
from pagedinfer.engine.server.generation import finish_reason_value
from pagedinfer.engine.server.sse_render import DONE, timing_dict, usage_dict
from pagedinfer.engine.server.tool_calls import ToolCalling, call_dict, new_call_id
from pagedinfer.engine.server.tool_parsers import Llama3JsonParser


@dataclass
class _ChoiceState:
    is_started: bool = False
    text: str = ""  # everything generated
    sent: int = 0  # characters of `text` sent as content
    in_call: bool = False  # auto: a call marker was seen; the rest is held
    is_plain: bool = False  # auto (llama3_json): the output does not open with a call
    call_id: str = ""


class ToolStreamRenderer:
    """`render(out)` gives the SSE events of one engine output (like SseRenderer)."""

    def __init__(self, rid: str, created: int, model: str, include_usage: bool, calling: ToolCalling) -> None:
        self._head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        self._include_usage = include_usage
        self._calling = calling
        self._choices: dict[int, _ChoiceState] = {}

    def render(self, out: RequestOutput) -> str:
        chunks = []
        for d in out.deltas:
            chunks.extend(self._choice_chunks(d))
        events = []
        for choice in chunks:
            payload = {**self._head, "choices": [choice]}
            if out.finished:
                payload["timing"] = timing_dict(out.timing)
            if self._include_usage:
                payload["usage"] = None
            events.append(_sse(payload))
        if out.finished:
            if self._include_usage:
                events.append(
                    _sse(
                        {
                            **self._head,
                            "choices": [],
                            "usage": usage_dict(out.usage),
                            "timing": timing_dict(out.timing),
                        }
                    )
                )
            events.append(DONE)
        return "".join(events)

    def _choice_chunks(self, d: CompletionDelta) -> list[dict]:
        state = self._choices.setdefault(d.index, _ChoiceState())
        state.text += d.text
        calling = self._calling
        deltas: list[dict] = []
        if calling.function is not None:
            if not state.is_started:
                state.call_id = new_call_id()
                first = call_dict_stream(0, state.call_id, calling.function.name)
                deltas.append({"content": None, "tool_calls": [first]})
            if d.text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]})
        elif calling.choice == "none":
            if d.text:
                deltas.append({"content": d.text})
        elif calling.choice == "auto":
            content = self._releasable(state)
            if content:
                deltas.append({"content": content})
        reason = None
        if d.finish_reason is not None:
            reason = finish_reason_value(d.finish_reason)
            finals, is_call = self._finish(state)
            deltas.extend(finals)
            if is_call and reason == "stop" and calling.function is None:
                reason = "tool_calls"
        chunks = []
        for delta in deltas:
            if not state.is_started:
                delta = {"role": "assistant", **delta}
                state.is_started = True
            chunks.append({"index": d.index, "delta": delta, "logprobs": None, "finish_reason": None})
        if reason is not None:
            final = {"index": d.index, "delta": {}, "logprobs": None, "finish_reason": reason}
            if d.error is not None:  # (as the plain stream does: the engine's reason)
                final["error"] = d.error
            chunks.append(final)
            if not state.is_started:
                chunks[-1]["delta"] = {"role": "assistant", "content": ""}
                state.is_started = True
        return chunks

    def _releasable(self, state: _ChoiceState) -> str:
        """auto: the content that can go out now (none once a call may have begun)."""
        if state.in_call:
            return ""
        parser = self._calling.parser
        pending = state.text[state.sent :]
        if isinstance(parser, Llama3JsonParser):  # a call is the whole output: it opens with it
            if not state.is_plain:
                head = state.text.lstrip()
                if not head:
                    return ""
                if head[0] in "{<":  # a call, or <|python_tag|>: held to the end
                    state.in_call = True
                    return ""
                state.is_plain = True
            state.sent = len(state.text)
            return pending
        marker = parser.start_marker
        at = pending.find(marker)
        if at >= 0:
            state.in_call = True
            state.sent += at
            return pending[:at]
        keep = next(
            (k for k in range(min(len(marker) - 1, len(pending)), 0, -1) if marker.startswith(pending[-k:])),
            0,
        )
        release = pending[: len(pending) - keep]
        state.sent += len(release)
        return release

    def _finish(self, state: _ChoiceState) -> tuple[list[dict], bool]:
        """The held part of a finished choice: its calls (first delta, then arguments), or content."""
        calling = self._calling
        if calling.function is not None or calling.choice == "none":
            return [], calling.function is not None
        held = state.text[state.sent :]
        if calling.choice == "required":
            content, calls = calling.calls_of(state.text)
        else:
            content, calls = calling.calls_of(state.text) if state.in_call else (None, [])
        if not calls:
            return ([{"content": held}] if held else []), False
        deltas = []
        for i, call in enumerate(calls):
            whole = call_dict(call)
            deltas.append({"tool_calls": [call_dict_stream(i, whole["id"], call.name)]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        return deltas, True


def call_dict_stream(index: int, call_id: str, name: str) -> dict:
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
