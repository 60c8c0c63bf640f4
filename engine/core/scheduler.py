"""Token-budgeted continuous batching with priorities, aging, chunked prefill and preemption.

There are no prefill/decode phases: each step every scheduled sequence's computed tokens
catch up with its known tokens (prompt + outputs + drafts) as far as the token budget allows.
Running sequences go first (highest priority, earliest admitted first), so decodes never stall
behind a long prompt; waiting sequences are admitted after them in (aged priority, preempted
first, arrival) order. CPU-only bookkeeping: no torch here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pagedinfer.engine.config import SchedulerConfig
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.scheduler_drafts import DraftReserves
from pagedinfer.engine.core.scheduler_output import (
    SamplingRow,
    ScheduledSequence,
    SchedulerOutput,
)
from pagedinfer.engine.core.scheduler_update import StepUpdate
from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.request import Request, RequestStatus


class Scheduler(DraftReserves, StepUpdate):
    """Decides, every step, which sequences compute which tokens; owns their KV blocks.

    schedule() is here; how drafts share the budget with prompt work is in DraftReserves
    (scheduler_drafts.py), update() in StepUpdate (scheduler_update.py)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._by_request_id: dict[str, list[Request]] = {}
        self.by_seq_id: dict[int, Request] = {}
        self._admit_counter = 0
        self._finished: list[Request] = []  # finished outside update(): errors, aborts
        self.pending_copies: list[tuple[int, int]] = []  # COW copies owed to the next step
        self._running_sorted = True  # running is in (priority desc, admit order) order
        self.num_preemptions_total = 0
        self.num_preemptions_step = 0  # since the engine last took it (its step stats)

    # ---- queue management -------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get_sequence(self, seq_id: int) -> Request | None:
        return self.by_seq_id.get(seq_id)

    def add_request(self, leader: Request, children: list[Request] = ()) -> None:
        """Queue a request's leader; `children` (n > 1) are forked from it after its prompt."""
        leader.pending_children = list(children)
        for child in children:
            child.status = RequestStatus.PENDING_FORK
        group = [leader, *children]
        self._by_request_id[leader.request_id] = group
        for seq in group:
            self.by_seq_id[seq.seq_id] = seq
        leader.status = RequestStatus.WAITING
        self.waiting.append(leader)

    def abort_request(self, request_id: str) -> list[Request]:
        """Finish every sequence of a request now (blocks freed); returns those that were live."""
        aborted: list[Request] = []
        for seq in self._by_request_id.get(request_id, []):
            aborted += self.finish_sequence(seq, FinishReason.ABORT)
        return aborted

    def finish_sequence(
        self,
        seq: Request,
        reason: FinishReason,
        stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> list[Request]:
        """Finish a sequence (and children it never forked) and free its blocks.

        Used for aborts, errors and stop strings; returns the sequences that finished.
        """
        if seq.is_finished:
            return []
        if seq.status is RequestStatus.RUNNING:
            self.kv.free(seq.seq_id)
            self.running.remove(seq)
        elif seq.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(seq)
        seq.status = RequestStatus.FINISHED
        seq.finish_reason, seq.stop_reason, seq.error = reason, stop_reason, error
        seq.finish_time = self.clock()
        finished = [seq]
        for child in seq.pending_children:
            # Children never forked share the leader's fate (they have no prompt KV of their own).
            finished += self.finish_sequence(child, reason, stop_reason, error)
        seq.pending_children = []
        self.forget_if_done(seq.request_id)
        return finished

    def forget_if_done(self, request_id: str) -> None:
        """Drop a request's sequences from the lookups once all of them finished."""
        group = self._by_request_id.get(request_id, [])
        if all(s.is_finished for s in group):
            for s in group:
                self.by_seq_id.pop(s.seq_id, None)
            self._by_request_id.pop(request_id, None)

    def take_finished(self) -> list[Request]:
        """Sequences finished outside update() since the last call (aborts, errors)."""
        finished, self._finished = self._finished, []
        return finished

    # ---- schedule -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Build one step's batch under the token budget and the sequence cap."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        copies, self.pending_copies = self.pending_copies, []
        preempted: list[int] = []
        self._preempt_for_priority(preempted)
        num_priority_preemptions = len(preempted)
        if not self._running_sorted:  # only appends (admission, forks) can break the order
            self.running.sort(key=lambda r: (-r.priority, r.admit_order))
            self._running_sorted = True
        reserves = self._draft_reserves(budget)
        budget = self._schedule_running(budget, scheduled, copies, preempted, reserves)
        if len(preempted) == num_priority_preemptions:  # running ones fit: admit more
            self._schedule_waiting(budget, scheduled)
        layout = None
        if scheduled:
            layout = self.kv.build_batch(
                [s.seq_id for s in scheduled],
                [s.num_computed_tokens for s in scheduled],
                [s.num_new_tokens for s in scheduled],
            )
        return SchedulerOutput(scheduled, layout, copies, preempted)

    def _num_new_tokens(self, seq: Request, budget: int, later: int = 0, reserved: int = 0) -> int:
        """Tokens `seq` computes this step within `budget`: its own (a prompt chunk, a decode's
        last token), then its drafts. `later`: the running sequences after it, a token each that
        a prompt chunk leaves them (a decode behind a long prompt of higher priority got none
        until the prompt was done); `reserved`: what its drafts leave (those tokens and the
        prompt work after it, `_draft_reserves`). Drafts are optional: another sequence's tokens
        come first (with a budget below batch x (K + 1) they did not: a review, 2026-12-06)."""
        # Never compute past the context: drafts beyond max_model_len are dropped. A leader whose
        # children fork at its next token verifies none (they would copy its accepted drafts as
        # computed: as the batched path, which takes no drafts there either).
        with_spec = seq.num_tokens if seq.pending_children else seq.num_tokens_with_spec
        remaining = max(min(with_spec, self.max_model_len) - seq.num_computed_tokens, 0)
        own = min(seq.num_tokens - seq.num_computed_tokens, remaining)
        if self.config.enable_chunked_prefill:
            if own > budget - later:
                return min(own, max(budget - later, 1), budget)  # a chunk (its own token at least)
        elif own > budget:
            return 0  # without chunking a prompt (or a decode's own token) is all or nothing
        return own + max(min(remaining - own, budget - reserved - own), 0)

    def _schedule_running(
        self,
        budget: int,
        scheduled: list[ScheduledSequence],
        copies: list[tuple[int, int]],
        preempted: list[int],
        reserves: dict[int, int] | None = None,
    ) -> int:
        """Schedule the running sequences (sorted) within `budget`, their drafts leaving a token
        for each later sequence and `reserves` (`_draft_reserves`). Returns the budget left."""
        fast = self._schedule_running_batched(budget, scheduled, copies, reserves)
        if fast is not None:
            return fast
        # The pool is short. Drafts are optional, so every running sequence's own tokens get KV
        # slots first (preempting from the tail where they do not fit) and the drafts after, in
        # what is left: one sequence's drafts never preempt another (they did: a review,
        # 2026-12-06). The token budget is spent as on the batched path (drafts included), so
        # with room for everything both paths schedule the same.
        i = 0
        with_drafts: list[tuple[int, Request, int]] = []  # (index in scheduled, seq, tokens wanted)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            later = len(self.running) - i - 1
            reserved = later + (reserves.get(seq.seq_id, 0) if reserves else 0)
            wanted = self._num_new_tokens(seq, budget, later, reserved)
            if wanted == 0:
                i += 1
                continue
            own = seq.num_tokens - seq.num_computed_tokens
            num_new = self._reserve_slots(seq, own if 0 < own < wanted else wanted, copies, preempted)
            if not num_new:
                continue  # `seq` itself left the running list
            if num_new < wanted:
                with_drafts.append((len(scheduled), seq, wanted))
            scheduled.append(self._scheduled(seq, num_new))
            budget -= wanted
            i += 1
        for index, seq, wanted in with_drafts:
            num_new = scheduled[index].num_new_tokens
            extra = wanted - num_new
            if seq.num_kv_tokens != seq.num_computed_tokens + num_new:
                continue
            result = self._append_drafts(seq, extra)
            if result is None:  # no block for them all: those that fit its last block's free slots
                extra = min(extra, -seq.num_kv_tokens % self.kv.block_size)
                result = self._append_drafts(seq, extra) if extra else None
                if result is None:
                    continue  # this step verifies none of its drafts
            copies.extend(result)
            seq.num_kv_tokens += extra
            scheduled[index] = self._scheduled(seq, num_new + extra)
        return budget

    def _schedule_running_batched(
        self,
        budget: int,
        scheduled: list[ScheduledSequence],
        copies: list[tuple[int, int]],
        reserves: dict[int, int] | None = None,
    ) -> int | None:
        """The common case in one KV call: every planned sequence gets its slots, or None."""
        planned: list[ScheduledSequence] = []
        plan: list[Request] = []
        seq_ids: list[int] = []
        counts: list[int] = []
        new_ids: list[int] = []
        max_len = self.max_model_len
        num_running = len(self.running)
        for index, seq in enumerate(self.running):
            if budget <= 0:
                break
            later = num_running - index - 1  # a token for each later sequence before drafts
            reserved = later + (reserves[seq.seq_id] if reserves else 0)
            computed = seq.num_computed_tokens
            out = seq.output_token_ids
            num_prompt = len(seq.prompt_token_ids)
            if (
                out
                and seq.num_kv_tokens == computed
                and computed + 1 == num_prompt + len(out)
                and computed < max_len
                and not seq.spec_token_ids
                and not seq.pending_children
            ):
                # A plain decode: its one input is the last sampled token, and it samples.
                ids = out[-1:]
                num_new = 1
                row = SamplingRow(
                    seq.seq_id, seq.sampling_params, seq.seed, len(out), seq.prompt_token_ids, out
                )
                planned.append(ScheduledSequence(seq.seq_id, ids, computed, num_prompt, 0, row, ()))
            elif (
                out
                and seq.num_kv_tokens == computed
                and computed + 1 == num_prompt + len(out)
                and computed + 1 + len(seq.spec_token_ids) <= min(max_len, computed + budget - reserved)
                and not seq.pending_children
            ):
                # A decode with drafts that all fit: inputs are the last token + the drafts.
                num_spec = len(seq.spec_token_ids)
                ids = [out[-1], *seq.spec_token_ids]
                num_new = 1 + num_spec
                row = SamplingRow(
                    seq.seq_id, seq.sampling_params, seq.seed, len(out), seq.prompt_token_ids, out
                )
                planned.append(ScheduledSequence(seq.seq_id, ids, computed, num_prompt, num_spec, row, ()))
            else:
                num_new = self._num_new_tokens(seq, budget, later, reserved)
                if num_new == 0:
                    continue
                ids = seq.token_ids_range(seq.num_kv_tokens, computed + num_new)
                # The KV tokens are the step's inputs exactly when no KV was reserved ahead of them.
                planned.append(self._scheduled(seq, num_new, ids if seq.num_kv_tokens == computed else None))
            plan.append(seq)
            seq_ids.append(seq.seq_id)
            counts.append(len(ids))
            new_ids.extend(ids)
            budget -= num_new
        result = self.kv.append_batch(seq_ids, new_ids, counts) if new_ids else []
        if result is None:
            return None
        copies.extend(result)
        for seq, count in zip(plan, counts, strict=True):
            seq.num_kv_tokens += count
        scheduled.extend(planned)
        return budget

    def _append_drafts(self, seq: Request, num: int):
        """KV slots for the next `num` of `seq`'s drafts after its reserved tokens (copy-on-write
        copies), or None when the pool cannot give them (nothing reserved then)."""
        return self.kv.append(seq.seq_id, seq.token_ids_range(seq.num_kv_tokens, seq.num_kv_tokens + num))

    def _reserve_slots(
        self, seq: Request, num_new: int, copies: list[tuple[int, int]], preempted: list[int]
    ) -> int:
        """Slots for the tokens `seq` computes this step -> how many it got (0: none, and `seq`
        left the running list). Its drafts go first when the pool is short: they are optional, so
        nothing is preempted (or failed) to make room for them. Then it preempts from the tail."""
        while True:
            new_ids = seq.token_ids_range(seq.num_kv_tokens, seq.num_computed_tokens + num_new)
            result = self.kv.append(seq.seq_id, new_ids)
            if result is not None:
                copies.extend(result)
                seq.num_kv_tokens += len(new_ids)
                return num_new
            without_drafts = min(num_new, seq.num_tokens - seq.num_computed_tokens)
            if 0 < without_drafts < num_new:
                num_new = without_drafts  # (the drafts stay unverified, as when the budget cuts them)
                continue
            victim = self.running[-1]
            if victim is seq:
                if len(self.running) == 1:
                    self._finished += self.finish_sequence(
                        seq, FinishReason.ERROR, error="sequence does not fit in the KV cache"
                    )
                else:
                    self._preempt(seq, preempted)
                return 0
            self._preempt(victim, preempted)

    def _preempt(self, seq: Request, preempted: list[int]) -> None:
        """Recompute-style preemption: free blocks, requeue at the front of its class."""
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_kv_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = RequestStatus.PREEMPTED
        self.waiting.append(seq)
        preempted.append(seq.seq_id)
        self.num_preemptions_total += 1
        self.num_preemptions_step += 1

    def may_preempt_for_priority(self) -> bool:
        """A waiting request has a strictly higher base priority than a running one: only then
        may a step preempt for priority (the exact test needs blocks and seats; the lookahead
        planners, core/lookahead.py, decline such steps). Cheap: no ranking of the queue."""
        waiting, running = self.waiting, self.running
        return bool(waiting and running) and max(r.priority for r in waiting) > min(
            r.priority for r in running
        )

    def _preempt_for_priority(self, preempted: list[int]) -> None:
        """Make room for a waiting request of strictly higher (base) priority than running ones."""
        if not self.may_preempt_for_priority():  # (see the victim check below)
            return
        key = self._waiting_key(self.clock())
        head = min(self.waiting, key=key)
        needed = self.kv.blocks_to_admit(head.num_tokens)
        while self.running and (
            needed > self.kv.num_free_blocks
            or self.num_seats_taken() + 1 + len(head.pending_children) > self.config.max_num_seqs
        ):
            victim = min(self.running, key=lambda r: (r.priority, -r.admit_order))
            if victim.priority >= head.priority or key(victim, preempted=True) <= key(head):
                # (the second: aged, the victim would be admitted again before the head, and be
                # preempted for it every step, never finishing; a fuzz found that livelock)
                return
            self._preempt(victim, preempted)

    def _waiting_key(self, now: float) -> Callable[..., tuple]:
        aging = self.config.aging_seconds

        def key(r: Request, preempted: bool = False) -> tuple:
            """`preempted`: as `r` would rank once preempted."""
            bonus = int((now - r.arrival_time) / aging) if aging > 0 else 0
            preempted = preempted or r.status is RequestStatus.PREEMPTED
            return (-(r.priority + bonus), not preempted, r.arrival_time, r.seq_id)

        return key

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSequence]) -> None:
        if not self.waiting or budget <= 0 or self.num_seats_taken() >= self.config.max_num_seqs:
            return  # every request needs a seat: no need to rank the queue
        self.waiting.sort(key=self._waiting_key(self.clock()))
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            seats = 1 + len(seq.pending_children)
            if self.num_seats_taken() + seats > self.config.max_num_seqs:
                return
            error = self._never_fits(seq)
            if error is not None:  # (a preempted sequence may have outgrown the pool or the budget)
                self._finished += self.finish_sequence(seq, FinishReason.ERROR, error=error)
                continue
            if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                return
            # prompt_logprobs need every prompt position's logits: no prefix-cache hits (as vLLM)
            use_cache = seq.sampling_params.prompt_logprobs is None
            num_cached = self.kv.allocate(seq.seq_id, seq.all_token_ids, use_cache)
            if num_cached is None:
                return  # strict order: a big head request is not starved by smaller ones
            self.waiting.pop(0)
            seq.num_kv_tokens = seq.num_tokens
            self._admit(seq, num_cached)
            num_new = self._num_new_tokens(seq, budget)
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new

    def _never_fits(self, seq: Request) -> str | None:
        """Why a waiting sequence can never be admitted, or None. A request's prompt is checked at
        arrival (request_checks), but a preempted sequence comes back with its outputs too, and
        the queue is strict order: without this it waited forever and everything behind it too
        (speculation made it reachable: a sequence sharing its prompt blocks grew past the pool;
        found by a review, 2026-12-06)."""
        kv = self.kv
        if kv.blocks_to_admit(seq.num_tokens) > kv.num_blocks:
            return "sequence does not fit in the KV cache"
        if not self.config.enable_chunked_prefill and seq.num_tokens > self.config.max_num_batched_tokens:
            return "sequence exceeds max_num_batched_tokens (chunked prefill is off)"
        return None

    def admit_waiting(self, budget: int, scheduled: list[ScheduledSequence]) -> None:
        """Admit waiting requests into `scheduled` within `budget` tokens, as a step's admission
        does (core/lookahead.py: into a lookahead step, behind its continuing sequences)."""
        self._schedule_waiting(budget, scheduled)

    def unadmit(self, seq: Request) -> None:
        """Undo an admission whose step never ran (a dropped lookahead): blocks back, the request
        back at the head of the queue as it was (waiting, or preempted before)."""
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_kv_tokens = 0
        if seq.num_preemptions:
            seq.status = RequestStatus.PREEMPTED
        else:  # that admission was its first: it was never scheduled (queue time, cached tokens)
            seq.status = RequestStatus.WAITING
            seq.first_scheduled_time = None
            seq.num_cached_tokens = 0
        self.waiting.insert(0, seq)

    def num_seats_taken(self) -> int:
        # Running leaders still owe seats to the children they will fork.
        return len(self.running) + sum(len(r.pending_children) for r in self.running)

    def _admit(self, seq: Request, num_cached: int) -> None:
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()
            seq.num_cached_tokens = num_cached
        seq.num_computed_tokens = num_cached
        seq.status = RequestStatus.RUNNING
        seq.admit_order = self._admit_counter
        self._admit_counter += 1
        self.running.append(seq)
        self._running_sorted = False

    def _scheduled(self, seq: Request, num_new: int, token_ids: list[int] | None = None) -> ScheduledSequence:
        """`token_ids`, when given, are the inputs [computed, computed + num_new) already sliced."""
        start = seq.num_computed_tokens
        end = start + num_new
        num_tokens = seq.num_tokens
        sample = None
        forks: tuple[SamplingRow, ...] = ()
        if end >= num_tokens:
            sample = self._sampling_row(seq)
            if seq.pending_children:
                forks = tuple(self._sampling_row(c) for c in seq.pending_children)
        if token_ids is None:
            token_ids = seq.token_ids_range(start, end)
        # Positional: this runs once per sequence per step.
        scheduled = ScheduledSequence(
            seq.seq_id, token_ids, start, len(seq.prompt_token_ids), max(end - num_tokens, 0), sample, forks
        )
        if seq.prompt_logprobs is not None and start < len(seq.prompt_token_ids) - 1:
            # input p predicts prompt token p + 1: this chunk's inputs up to the prompt's last but one
            scheduled.prompt_targets = seq.prompt_token_ids[
                start + 1 : min(end, len(seq.prompt_token_ids) - 1) + 1
            ]
            scheduled.num_prompt_logprobs = seq.sampling_params.prompt_logprobs
        return scheduled

    @staticmethod
    def _sampling_row(seq: Request) -> SamplingRow:
        # seq_id, sampling_params, seed, output_position, prompt_token_ids, output_token_ids
        return SamplingRow(
            seq.seq_id,
            seq.sampling_params,
            seq.seed,
            len(seq.output_token_ids),
            seq.prompt_token_ids,
            seq.output_token_ids,
        )
