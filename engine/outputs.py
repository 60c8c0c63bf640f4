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


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

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
