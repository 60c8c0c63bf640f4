"""The choices of a non-streamed /v1/completions answer: echo, best_of, prompt logprobs.

One prompt's engine request gives `best_of` (else n) sequences; the n with the highest
cumulative logprob are its choices, indexed as OpenAI does (prompt_index * n + i). `echo` puts
the prompt before each choice's text and, with `logprobs`, the prompt tokens' entries before the
generated ones (the first prompt token has none: null, as OpenAI answers). echo with
max_tokens 0 answers the prompt alone (the engine generated one token, left out here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedinfer.engine.outputs import CompletionDelta, SampleLogprobs
from pagedinfer.engine.server.generation import finish_reason_value
from pagedinfer.engine.server.openai_protocol import CompletionRequest


@dataclass
class CollectedChoice:
    """One sequence's whole output, gathered from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list[SampleLogprobs] | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = finish_reason_value(delta.finish_reason)
            self.error = delta.error

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.sampled.logprob for lp in self.logprobs or ())


@dataclass(frozen=True)
class PromptEcho:
    """What echo and prompt_logprobs need of one prompt."""

    text: str  # the prompt as text (token-id prompts: decoded)
    first_token: str  # the first prompt token's text (it has no logprob)
    first_token_id: int


def completion_choices(
    body: CompletionRequest,
    prompt_index: int,
    collected: dict[int, CollectedChoice],
    echo: PromptEcho | None,
) -> list[dict[str, Any]]:
    """The prompt's n choices (best of its sequences), in OpenAI's order and indices."""
    ranked = sorted(collected.values(), key=lambda c: -c.cumulative_logprob)
    kept = ranked[: body.n] if len(collected) > body.n else [collected[i] for i in sorted(collected)]
    prompt_lps = next((c.prompt_logprobs for c in collected.values() if c.prompt_logprobs), None)
    return [_choice(body, prompt_index * body.n + i, c, echo, prompt_lps) for i, c in enumerate(kept)]


def _choice(
    body: CompletionRequest,
    index: int,
    c: CollectedChoice,
    echo: PromptEcho | None,
    prompt_lps: list[SampleLogprobs] | None,
) -> dict[str, Any]:
    generated = not body.is_prompt_only
    text = c.text if generated else ""
    logprobs = None
    if body.logprobs is not None:
        entries: list[SampleLogprobs | None] = []
        if body.echo and echo is not None:
            entries = [None, *(prompt_lps or [])]
        entries += (c.logprobs or [])[: None if generated else 0]
        logprobs = _logprobs_dict(entries, body.logprobs, echo)
    if body.echo and echo is not None:
        text = echo.text + text
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason if generated else "length",
    }
    if body.prompt_logprobs is not None and echo is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(echo, prompt_lps or [], body.prompt_logprobs)
    if c.error is not None:
        choice["error"] = c.error
    return choice


def _logprobs_dict(
    entries: Sequence[SampleLogprobs | None], k: int, echo: PromptEcho | None
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; a None entry is the first echoed prompt token's."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    pos = 0
    for lp in entries:
        token = echo.first_token if lp is None and echo is not None else lp.sampled.token if lp else ""
        tokens.append(token)
        token_logprobs.append(None if lp is None else lp.sampled.logprob)
        top_logprobs.append(None if lp is None else {t.token: t.logprob for t in lp.top[:k]})
        offsets.append(pos)
        pos += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    echo: PromptEcho, prompt_lps: Sequence[SampleLogprobs], k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then per prompt token a map from token
    id to {logprob, rank, decoded_token} holding the prompt token and the top k. Ranks are known
    for the top k (1..k); a prompt token outside them has rank null."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in prompt_lps:
        top = lp.top[:k]
        entry = {
            str(t.token_id): {"logprob": t.logprob, "rank": r, "decoded_token": t.token}
            for r, t in enumerate(top, start=1)
        }
        s = lp.sampled
        if str(s.token_id) not in entry:
            entry[str(s.token_id)] = {"logprob": s.logprob, "rank": None, "decoded_token": s.token}
        out.append(entry)
    return out
