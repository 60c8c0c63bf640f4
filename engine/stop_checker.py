"""Stop conditions: token-level (scheduler side) and stop strings (text side).

Token-level checks run right after each token is appended, in this order: min_tokens gates
EOS/stop ids; then EOS, stop token ids, max_tokens and the model's context length.
Stop strings are matched on detokenized text by `StopStringMatcher`, which also holds back
the tail of the text that could still become a stop string, so a stream never shows one.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.request import Request


@dataclass(frozen=True)
class StopDecision:
    reason: FinishReason
    stop_reason: str | int | None = None


def check_token_stop(request: Request, max_model_len: int) -> StopDecision | None:
    """Whether the sequence must stop after its last appended token."""
    params = request.sampling_params
    num_output = request.num_output_tokens
    last = request.output_token_ids[-1]
    # The sampler masks EOS/stop ids at output positions < min_tokens; mirror that here.
    if num_output > params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            return StopDecision(FinishReason.STOP, None)
        if last in params.stop_token_ids:
            return StopDecision(FinishReason.STOP, last)
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return StopDecision(FinishReason.LENGTH)
    if request.num_tokens >= max_model_len:
        return StopDecision(FinishReason.LENGTH)
    return None


def may_stop(request: Request, token_id: int, max_model_len: int) -> bool:
    """A cheap superset of `check_token_stop` for appending `token_id`: False means it cannot
    stop there (min_tokens is ignored: it only ever prevents a stop)."""
    num_output = len(request.output_token_ids) + 1
    max_tokens = request.sampling_params.max_tokens
    return (
        token_id in request.stop_token_set
        or num_output >= max_model_len - len(request.prompt_token_ids)
        or (max_tokens is not None and num_output >= max_tokens)
    )


class StopStringMatcher:
    """Finds stop strings in a growing text and says how much of it is safe to stream.

    `feed(text_so_far, num_new_chars)` returns (index of the first stop match or None,
    the stop string). `safe_len(text, is_final)` is the length that may be shown now.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.max_len = max((len(s) for s in stop), default=0)

    def find(self, text: str, num_new_chars: int) -> tuple[int, str] | None:
        if not self.stop:
            return None
        # Only the new chars, plus enough of the old to catch a match straddling them.
        start = max(len(text) - num_new_chars - self.max_len + 1, 0)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def safe_len(self, text: str, is_final: bool) -> int:
        """Length of the prefix of `text` that cannot be the start of a stop string."""
        if is_final or not self.stop:
            return len(text)
        hold = 0
        for s in self.stop:
            # Longest suffix of text that is a proper prefix of s.
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return len(text) - hold
