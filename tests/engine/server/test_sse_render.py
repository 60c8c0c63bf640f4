"""The template SSE rendering equals the plain dict rendering, and the OpenAI SDK's models accept it."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from pagedinfer.engine.outputs import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    RequestTiming,
    SampleLogprobs,
    TokenLogprob,
    Usage,
)
from pagedinfer.engine.server.sse_render import (
    SseRenderer,
    chat_logprobs,
    completion_logprobs,
    timing_dict,
    usage_dict,
)

TIMING = RequestTiming(0.01, 0.02, 0.3, 0.32, 25.0)


def _lp(token: str, logprob: float) -> SampleLogprobs:
    return SampleLogprobs(
        TokenLogprob(7, token, logprob), (TokenLogprob(7, token, logprob), TokenLogprob(9, "x", -3.5))
    )


def _stream(n: int, with_logprobs: bool) -> list[RequestOutput]:
    """Three outputs of an n-choice request: texts with quotes, unicode and control characters."""
    texts = ['Hé "quoted"\n', "\u4e16\u754c\t\\ \U0001f600", "</s>\x01"]
    outs = []
    for step, text in enumerate(texts):
        last = step == len(texts) - 1
        deltas = [
            CompletionDelta(
                index=i,
                text=text + str(i),
                token_ids=[1],
                logprobs=[_lp(text, -0.25 * (step + 1)), _lp("b", -1e-9)] if with_logprobs else None,
                finish_reason=(FinishReason.LENGTH if i else FinishReason.STOP) if last else None,
            )
            for i in range(n)
        ]
        usage = Usage(5, 3 * n, cached_prompt_tokens=step) if last else None
        outs.append(RequestOutput("r", deltas, finished=last, usage=usage, timing=TIMING if last else None))
    return outs


def _reference(outs: list[RequestOutput], obj: str, include_usage: bool) -> list[dict | str]:
    """The dict-per-chunk rendering the server used before the templates."""
    base = {"id": "cmpl-1", "object": obj, "created": 1700000000, "model": "m/\u00e9"}
    offsets: dict[int, int] = {}
    started: set[int] = set()
    events: list[dict | str] = []
    for out in outs:
        tail = {} if not out.finished else {"timing": timing_dict(out.timing)}
        if include_usage:
            tail["usage"] = None
        for d in out.deltas:
            finish = d.finish_reason.value if d.finish_reason else None
            if obj == "text_completion":
                lp = completion_logprobs(d.logprobs, offsets.get(d.index, 0))
                if d.logprobs is not None:  # offsets by the tokens' text, as the whole response's
                    offsets[d.index] = offsets.get(d.index, 0) + sum(len(x.sampled.token) for x in d.logprobs)
                choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": finish}
            else:
                delta = {"content": d.text} | ({} if d.index in started else {"role": "assistant"})
                started.add(d.index)
                choice = {"index": d.index, "delta": delta, "logprobs": chat_logprobs(d.logprobs)}
                choice["finish_reason"] = finish
            events.append({**base, "choices": [choice], **tail})
        if out.finished and include_usage:
            usage = {"usage": usage_dict(out.usage), "timing": timing_dict(out.timing)}
            events.append({**base, "choices": [], **usage})
    return [*events, "[DONE]"]


def _parse(body: str) -> list[dict | str]:
    assert body.endswith("\n\n")
    events = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block  # one line per event
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("obj", ["text_completion", "chat.completion.chunk"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("with_logprobs", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_template_rendering_equals_dict_rendering(obj, n, with_logprobs, include_usage) -> None:
    outs = _stream(n, with_logprobs)
    renderer = SseRenderer("cmpl-1", 1700000000, "m/\u00e9", obj, include_usage)
    bodies = [renderer.render(out) for out in outs]
    assert all(body.isascii() for body in bodies)
    events = _parse("".join(bodies))
    assert events == _reference(outs, obj, include_usage)
    for event in events[:-1]:
        if obj == "chat.completion.chunk":
            parsed = ChatCompletionChunk.model_validate(event)
        elif all(c["finish_reason"] for c in event["choices"]):  # the SDK's Completion wants one
            parsed = Completion.model_validate(event)
        else:
            continue
        assert parsed.id == "cmpl-1" and parsed.object == obj


def test_each_output_is_one_write_with_all_its_events() -> None:
    outs = _stream(3, with_logprobs=False)
    renderer = SseRenderer("c", 1, "m", "text_completion", include_usage=True)
    bodies = [renderer.render(out) for out in outs]
    assert [len(_parse(b)) for b in bodies] == [3, 3, 3 + 1 + 1]  # last: 3 choices, usage, [DONE]


def test_finished_output_without_deltas_still_ends_the_stream() -> None:
    out = RequestOutput("r", [], finished=True, usage=Usage(2, 0), timing=TIMING)
    events = _parse(SseRenderer("c", 1, "m", "chat.completion.chunk", True).render(out))
    assert events[-1] == "[DONE]" and events[0]["choices"] == [] and events[0]["usage"]["total_tokens"] == 2


def test_streamed_text_offsets_follow_the_tokens_when_text_is_held_back() -> None:
    # " was" may start the stop string " was it": the first delta holds its text back, the next
    # releases it with its own token's. text_offset must be the non-streamed response's.
    tokens = ["It", " was", " late"]
    deltas = [([0], "It"), ([1], ""), ([2], " was late")]
    renderer = SseRenderer("cmpl-1", 1700000000, "m", "text_completion", include_usage=False)
    offsets = []
    for ids, text in deltas:
        lp = [_lp(tokens[j], -0.5) for j in ids]
        out = RequestOutput("r", [CompletionDelta(index=0, text=text, token_ids=ids, logprobs=lp)])
        (event,) = [e for e in _parse(renderer.render(out)) if isinstance(e, dict)]
        offsets += event["choices"][0]["logprobs"]["text_offset"]
    whole = [_lp(token, -0.5) for token in tokens]
    assert offsets == completion_logprobs(whole)["text_offset"] == [0, 2, 6]
