"""The update half of the scheduler: apply one step's results to its sequences (computed
tokens, rejected drafts, forks, appended tokens, stop conditions, freed blocks).

A mixin of `Scheduler` (core/scheduler.py), which owns the state it reads: the sequences by id,
the running list, the KV manager, the copies owed to the next step. CPU-only: no torch here.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    PromptLogprobs,
    SampledTokens,
    SchedulerOutput,
    SequenceUpdate,
)
from pagedinfer.engine.request import Request, RequestStatus
from pagedinfer.engine.stop_checker import check_token_stop, may_stop


class StepUpdate:
    """Scheduler.update(): a step's results -> the sequences' new state and their updates."""

    kv: KVCacheManager
    max_model_len: int
    clock: Callable[[], float]
    running: list[Request]
    by_seq_id: dict[int, Request]
    pending_copies: list[tuple[int, int]]
    _admit_counter: int
    _running_sorted: bool

    def forget_if_done(self, request_id: str) -> None:
        raise NotImplementedError  # Scheduler's

    def update(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, kv_ahead: frozenset[int] = frozenset()
    ) -> list[SequenceUpdate]:
        """Apply a step's results: advance computed tokens, fork, append, stop, free.

        `kv_ahead`: sequences whose next step is already launched with KV reserved past this
        one's (a chained speculative step): rejected drafts leave their KV to that step's resolve.
        """
        if sched.num_device_steps > 1 or sched.model_drafts:
            self._record_device_inputs(sched, result)
        by_seq_id = self.by_seq_id
        running = RequestStatus.RUNNING
        live: list[Request] = []  # scheduled and still running (not aborted or stopped meanwhile)
        num_spec: dict[int, int] = {}  # seq_id -> drafts verified this step, where any
        for s in sched.sequences:
            seq = by_seq_id.get(s.seq_id)
            if seq is not None and seq.status is running:
                seq.num_computed_tokens += len(s.token_ids)
                if s.fork_rows and s.sample is not None:
                    self._fork_children(seq)
                live.append(seq)
            if s.num_spec_tokens:
                num_spec[s.seq_id] = s.num_spec_tokens
        if result.prompt_logprobs:
            self._add_prompt_logprobs(result.prompt_logprobs)
        updates: list[SequenceUpdate] = []
        for st in result.sampled:
            u = self._apply_sampled(st, num_spec.get(st.seq_id, 0) if num_spec else 0, st.seq_id in kv_ahead)
            if u is not None:
                updates.append(u)
        if live:
            self.kv.mark_computed([r.seq_id for r in live], [r.num_computed_tokens for r in live])
        for u in updates:
            if not u.is_finished:
                continue
            seq = by_seq_id.get(u.seq_id)
            if seq is not None and seq.status is running:
                self.kv.free(seq.seq_id)
                self.running.remove(seq)
                seq.status = RequestStatus.FINISHED
                seq.finish_time = self.clock()
                self.forget_if_done(seq.request_id)
        return updates

    def _add_prompt_logprobs(self, chunks: list[PromptLogprobs]) -> None:
        """Append each chunk's prompt logprobs past those the sequence holds (a preempted
        sequence recomputes its prompt: positions it has already are not added twice)."""
        for chunk in chunks:
            seq = self.by_seq_id.get(chunk.seq_id)
            if seq is None or seq.prompt_logprobs is None:
                continue
            skip = len(seq.prompt_logprobs) - chunk.start  # entries already held
            if skip >= 0:
                seq.prompt_logprobs.extend(chunk.entries[skip:])

    def _fork_children(self, leader: Request) -> None:
        for child in leader.pending_children:
            self.kv.fork(leader.seq_id, child.seq_id)
            child.num_computed_tokens = leader.num_computed_tokens
            child.num_kv_tokens = leader.num_kv_tokens
            child.num_cached_tokens = leader.num_cached_tokens
            child.first_scheduled_time = leader.first_scheduled_time
            child.status = RequestStatus.RUNNING
            child.admit_order = self._admit_counter
            self._admit_counter += 1
            self.running.append(child)
            self._running_sorted = False
        leader.pending_children = []

    def _apply_sampled(
        self, sampled: SampledTokens, num_spec: int, kv_ahead: bool = False
    ) -> SequenceUpdate | None:
        seq = self.by_seq_id.get(sampled.seq_id)
        if seq is None or seq.status is not RequestStatus.RUNNING:
            return None
        num_rejected = num_spec - (len(sampled.token_ids) - 1)
        if num_rejected > 0:
            seq.num_computed_tokens -= num_rejected
            if not kv_ahead:  # drafts after the first rejected one left stale KV behind: drop it
                self.pending_copies += self.kv.truncate(seq.seq_id, seq.num_computed_tokens)
                seq.num_kv_tokens = seq.num_computed_tokens
        if seq.spec_token_ids:
            seq.spec_token_ids = []
        token_ids = sampled.token_ids
        if len(token_ids) == 1 and not may_stop(seq, token_ids[0], self.max_model_len):
            seq.output_token_ids.append(token_ids[0])  # the common case: one token, no stop
            new_ids = token_ids
        elif not may_stop_tokens(seq, token_ids, self.max_model_len):
            seq.output_token_ids.extend(token_ids)  # verified drafts + one, none of which stops
            new_ids = token_ids
        else:
            new_ids = []
            for token_id in token_ids:
                seq.output_token_ids.append(token_id)
                new_ids.append(token_id)
                decision = check_token_stop(seq, self.max_model_len)
                if decision is not None:
                    seq.finish_reason, seq.stop_reason = decision.reason, decision.stop_reason
                    break
        prompt_logprobs = None
        if seq.first_token_time is None:
            seq.first_token_time = self.clock()
            prompt_logprobs = seq.prompt_logprobs  # (None unless asked for: sent once, here)
        logprobs = sampled.logprobs[: len(new_ids)] if sampled.logprobs is not None else None
        update = SequenceUpdate(
            seq.seq_id, seq.request_id, seq.index, new_ids, logprobs, seq.finish_reason is not None
        )
        if prompt_logprobs is not None:
            update.prompt_logprobs = prompt_logprobs
        return update

    def _record_device_inputs(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Before a step of several device steps is applied: its KV positions that stay computed get
        the ids its device steps consumed there (each step's inputs were its predecessor's bonus
        token and drafts, of which the accepted ones were emitted), so prefix-cache hashes see them."""
        by_seq_id = self.by_seq_id
        running = RequestStatus.RUNNING
        emitted = {st.seq_id: st.token_ids for st in result.sampled}
        for s in sched.sequences[: sched.num_fed]:  # (prompts it admitted ran their real inputs)
            seq = by_seq_id.get(s.seq_id)
            tokens = emitted.get(s.seq_id)
            if seq is None or seq.status is not running or not tokens:
                continue
            self.kv.set_tokens(s.seq_id, s.num_computed_tokens, [s.token_ids[0], *tokens[:-1]])


def may_stop_tokens(seq: Request, token_ids: list[int], max_model_len: int) -> bool:
    """`may_stop` for appending several tokens: False means none of them can stop the sequence
    (each condition is checked at the largest output count, where it is likeliest)."""
    num_output = len(seq.output_token_ids) + len(token_ids)
    max_tokens = seq.sampling_params.max_tokens
    return (
        num_output >= max_model_len - len(seq.prompt_token_ids)
        or (max_tokens is not None and num_output >= max_tokens)
        or not seq.stop_token_set.isdisjoint(token_ids)
    )
