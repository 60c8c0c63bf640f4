"""Incremental, UTF-8 safe detokenization with stop strings held back from the stream.

Byte-level BPE splits a multi-byte character across tokens; decoding a prefix of them yields
U+FFFD. The window trick (vLLM's `detokenize_incrementally`): decode a few tokens of context
plus the new ones and emit only the text that extends the context's decoding, and only once it
no longer ends in U+FFFD. Decoding the context too keeps SentencePiece-style leading spaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedinfer.engine.stop_checker import StopStringMatcher

_CONTEXT_TOKENS = 6  # prompt tokens decoded as context for the first output tokens
_TRIM_AT = 64  # drop consumed tokens beyond this many to keep decoding O(window)


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """One sequence's growing output text.

    `push(ids)` returns the newly safe-to-show text and, when a stop string matched, that
    string (the text is cut before it and the sequence must finish); `num_pushed_kept` then says
    how many of the pushed ids came up to and including the one that completed the match (the
    rest - several tokens a step, speculative decoding - are past the stop). `flush()` releases
    the held-back tail once the sequence finished for another reason.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""  # all output text so far (cut before a matched stop string)
        self._num_emitted = 0
        self._matcher = StopStringMatcher(stop)
        self.stopped_on: str | None = None
        self.num_pushed_kept = 0  # of the last push's ids: those up to the stop (all: no stop)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append_token(self, token_id: int) -> str:
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # an incomplete character (or nothing visible) so far
        delta = full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        if self._prefix_offset > _TRIM_AT:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def push(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Add tokens; returns (text to stream now, matched stop string or None)."""
        if self.stopped_on is not None:
            self.num_pushed_kept = 0
            return "", self.stopped_on
        self.num_pushed_kept = len(token_ids)
        for i, token_id in enumerate(token_ids):
            delta = self._append_token(token_id)
            if not delta:
                continue
            self.text += delta
            match = self._matcher.find(self.text, len(delta))
            if match is not None:
                self.text = self.text[: match[0]]
                self.stopped_on = match[1]
                self.num_pushed_kept = i + 1
                break
        return self._take(is_final=self.stopped_on is not None), self.stopped_on

    def flush(self) -> str:
        """Everything not yet streamed (the sequence finished)."""
        return self._take(is_final=True)

    def _take(self, is_final: bool) -> str:
        safe = self._matcher.safe_len(self.text, is_final)
        if safe <= self._num_emitted:
            return ""
        out = self.text[self._num_emitted : safe]
        self._num_emitted = safe
        return out
