"""What the engine streams back for one request: typed, incremental, server-agnostic."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; the string values are the OpenAI API's."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # client gone, deadline, shutdown
    ERROR = "error"  # the engine could not serve it (e.g. it can never fit in the KV cache)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class SampleLogprobs:
    """Logprob of the sampled token plus the top-n alternatives at that position."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass
class CompletionDelta:
    """New output of one of the request's n sequences since the previous RequestOutput."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that matched
    error: str | None = None  # set with FinishReason.ERROR
    # prompt_logprobs: prompt tokens 1.. (the first has none), once, with the first output token
    prompt_logprobs: list[SampleLogprobs] | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    # speculative decoding: draft tokens verified for the request's completions, and those accepted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestTiming:
    """Per-request latency attribution, in seconds (all measured with time.monotonic)."""

    queue_time: float  # arrival -> first scheduled
    time_to_first_token: float  # arrival -> first output token
    decode_time: float  # first token -> last token
    e2e_latency: float  # arrival -> finish
    tokens_per_second: float  # completion tokens / decode_time (0 when one token)


@dataclass
class RequestOutput:
    """One streamed update. `finished` is True exactly once, on the last update."""

    request_id: str
    deltas: list[CompletionDelta]
    finished: bool = False
    usage: Usage | None = None  # set on the last update
    timing: RequestTiming | None = None  # set on the last update


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Several consecutive updates of one request as one: per completion index the text, token
    ids and logprobs concatenate in order; finish and stop info, usage and timing come from the
    latest update that has them. A lagging stream sends this instead of one message per step."""
    if len(outputs) == 1:
        return outputs[0]
    merged: dict[int, CompletionDelta] = {}
    for out in outputs:
        for d in out.deltas:
            m = merged.get(d.index)
            if m is None:
                m = merged[d.index] = CompletionDelta(d.index)
            m.text += d.text
            m.token_ids = m.token_ids + d.token_ids
            if d.logprobs is not None:
                m.logprobs = (m.logprobs or []) + d.logprobs
            if d.prompt_logprobs is not None:
                m.prompt_logprobs = d.prompt_logprobs
            if d.finish_reason is not None:
                m.finish_reason, m.stop_reason, m.error = d.finish_reason, d.stop_reason, d.error
    last = outputs[-1]
    usage = next((o.usage for o in reversed(outputs) if o.usage is not None), None)
    timing = next((o.timing for o in reversed(outputs) if o.timing is not None), None)
    return RequestOutput(last.request_id, list(merged.values()), last.finished, usage, timing)
