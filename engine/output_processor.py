"""Turns per-sequence token updates into per-request `RequestOutput`s (text, logprobs, usage).

Runs on the engine thread right after `scheduler.update()`, so a stop string found in the
text finishes the sequence (and frees its blocks) in the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedinfer.engine.core.scheduler import Scheduler
from pagedinfer.engine.core.scheduler_output import SequenceUpdate, TokenLogprobs, verifications_within
from pagedinfer.engine.detokenizer import Decoder, IncrementalDetokenizer
from pagedinfer.engine.outputs import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    RequestTiming,
    SampleLogprobs,
    TokenLogprob,
    Usage,
)
from pagedinfer.engine.request import Request


@dataclass
class _RequestState:
    sequences: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    reported_finished: list[bool] = field(default_factory=list)


class OutputProcessor:
    """Keeps one incremental detokenizer per sequence and assembles client-facing deltas."""

    def __init__(self, tokenizer: Decoder | None, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._states: dict[str, _RequestState] = {}
        # Running totals for the step accounting: tokens a step applied that a stop string cut
        # off (never output), and sequences a stop string finished here.
        self.num_cut_tokens = 0
        self.num_stopped = 0

    def __len__(self) -> int:
        return len(self._states)

    def add(self, sequences: list[Request]) -> None:
        detoks = [self._detokenizer(s) for s in sequences]
        self._states[sequences[0].request_id] = _RequestState(sequences, detoks, [False] * len(sequences))

    def _detokenizer(self, seq: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        params = seq.sampling_params
        return IncrementalDetokenizer(
            self.tokenizer,
            seq.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
        )

    def process(self, updates: Sequence[SequenceUpdate], finished: Sequence[Request]) -> list[RequestOutput]:
        """One RequestOutput per request that changed this step."""
        deltas: dict[str, dict[int, CompletionDelta]] = {}
        for u in updates:
            state = self._states.get(u.request_id)
            if state is not None:
                deltas.setdefault(u.request_id, {})[u.index] = self._delta(state, u)
        for seq in finished:
            if seq.request_id in self._states:
                deltas.setdefault(seq.request_id, {}).setdefault(seq.index, CompletionDelta(seq.index))
        outputs = []
        for request_id, by_index in deltas.items():
            state = self._states[request_id]
            for index, delta in by_index.items():
                self._finish_delta(state, index, delta)
            outputs.append(self._request_output(request_id, state, list(by_index.values())))
        return outputs

    def _delta(self, state: _RequestState, u: SequenceUpdate) -> CompletionDelta:
        delta = CompletionDelta(u.index, token_ids=list(u.new_token_ids))
        logprobs = u.logprobs
        detok = state.detokenizers[u.index]
        if detok is not None:
            delta.text, stop = detok.push(u.new_token_ids)
            seq = state.sequences[u.index]
            if stop is not None:
                # Tokens past the stop string (a step emitted several) are not output: as one
                # token a step would have it, the last one is the token that completed the match.
                past = len(delta.token_ids) - detok.num_pushed_kept
                if past > 0:
                    del delta.token_ids[-past:]
                    del seq.output_token_ids[-past:]
                    logprobs = logprobs[:-past] if logprobs is not None else None
                    self.num_cut_tokens += past
            if stop is not None and not seq.is_finished:
                self.scheduler.finish_sequence(seq, FinishReason.STOP, stop_reason=stop)
                self.num_stopped += 1
            elif stop is not None and seq.finish_reason is not FinishReason.ABORT:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
        if logprobs is not None:
            delta.logprobs = [self._logprobs(lp) for lp in logprobs]
        if u.prompt_logprobs is not None:
            delta.prompt_logprobs = [self._logprobs(lp) for lp in u.prompt_logprobs]
        if u.verifications:
            _count_drafts(state.sequences[u.index], u.verifications, len(delta.token_ids))
        return delta

    def _finish_delta(self, state: _RequestState, index: int, delta: CompletionDelta) -> None:
        seq = state.sequences[index]
        if not seq.is_finished or state.reported_finished[index]:
            return
        detok = state.detokenizers[index]
        if detok is not None:
            delta.text += detok.flush()
        delta.finish_reason, delta.stop_reason, delta.error = seq.finish_reason, seq.stop_reason, seq.error
        state.reported_finished[index] = True

    def _request_output(
        self, request_id: str, state: _RequestState, deltas: list[CompletionDelta]
    ) -> RequestOutput:
        deltas.sort(key=lambda d: d.index)
        out = RequestOutput(request_id, deltas)
        if all(state.reported_finished):
            out.finished = True
            leader = state.sequences[0]
            out.usage = Usage(
                prompt_tokens=leader.num_prompt_tokens,
                completion_tokens=sum(s.num_output_tokens for s in state.sequences),
                cached_prompt_tokens=leader.num_cached_tokens,
                draft_tokens=sum(s.num_draft_tokens for s in state.sequences),
                accepted_draft_tokens=sum(s.num_accepted_tokens for s in state.sequences),
            )
            out.timing = _timing(state.sequences)
            del self._states[request_id]
        return out

    def _logprobs(self, lp: TokenLogprobs) -> SampleLogprobs:
        def one(token_id: int, logprob: float) -> TokenLogprob:
            text = (
                "" if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)
            )
            return TokenLogprob(token_id, text, logprob)

        top = tuple(one(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=False))
        return SampleLogprobs(one(lp.token_id, lp.logprob), top)


def _count_drafts(seq: Request, verifications: list[tuple[int, int]], num_kept: int) -> None:
    """A step's verifications onto the sequence's usage counts, up to the num_kept tokens output
    (a stop string can cut the step's last ones): each verification's tokens are its accepted
    drafts and one more; one cut inside its accepted drafts counts up to the cut (`within_end`),
    one cut whole not at all."""
    for drafts, accepted, _ in verifications_within(((d, a + 1) for d, a in verifications), num_kept):
        seq.num_draft_tokens += drafts
        seq.num_accepted_tokens += accepted


def _timing(sequences: list[Request]) -> RequestTiming:
    leader = sequences[0]
    arrival = leader.arrival_time
    finish = max((s.finish_time or arrival) for s in sequences)
    first_sched = leader.first_scheduled_time or finish
    first_token = min((s.first_token_time for s in sequences if s.first_token_time), default=finish)
    completion = sum(s.num_output_tokens for s in sequences)
    decode_time = max(finish - first_token, 0.0)
    return RequestTiming(
        queue_time=max(first_sched - arrival, 0.0),
        time_to_first_token=max(first_token - arrival, 0.0),
        decode_time=decode_time,
        e2e_latency=max(finish - arrival, 0.0),
        tokens_per_second=(completion - len(sequences)) / decode_time if decode_time > 0 else 0.0,
    )
