"""Chained speculative steps: plan step N+1 of an n-gram batch before step N's acceptance is known.

Step N (launched, acceptance decided on the device: spec_decode/device_chain.py) verified K_N
drafts per sequence; N+1 verifies K new drafts after N's bonus token, in M device steps launched
back to back (each verifying the drafts the one before made). The host does not know how many of
N's drafts survive, so it plans N+1 for the case that all of them and all of N+1's do (block
tables and context lengths: an upper bound) and reserves KV for it: M x (K + 1) placeholder slots
past N's. Each device step's inputs (bonus token, drafts, positions, slots, context length) are
written on the device from the token histories (`DeviceNgramChain.feed`).

Once N's tokens are applied (`Scheduler.update` leaves the KV of these sequences alone), N+1's
first inputs are known and the KV reservation shrinks to N+1's own extent: `resolve_spec_lookahead`;
N+1's update records the ids its later device steps consumed (`StepUpdate._record_device_inputs`, core/scheduler_update.py). N+1 is
then an ordinary record of what ran, and the next step is planned from it the same way.

A chain continues N's batch: every running sequence was in N, samples there, and its sampling can
be decided on the device (greedy, or sampled without penalties, min_tokens bans or logprobs: each
row drawn there); nothing can be preempted; each sequence has room for a verification in its
context. Sequences that stopped since N was planned, or reach max_tokens at
N for certain, get no row (the device histories are compacted to the rows that go on:
`DeviceNgramChain.select_rows`). Waiting requests the synchronous step would admit are admitted
behind the chained rows, with their real inputs (a refilled batch would otherwise be synchronous
at every admission), if their sampling can ride (`may_ride`) and they speculate: their first
token is decided on the device too, their histories join the chain's
(`DeviceNgramChain.add_rows`), and the next step chains them (a draft model's cache is prefilled
for them then). Anything else (a request with penalties or logprobs, one that fits only once the
chain's reservations are released, a sequence without room) ends the chain: the next step is
scheduled synchronously, with drafts from the host proposer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedinfer.engine.core.lookahead import PLACEHOLDER_TOKEN_ID
from pagedinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SamplingRow,
    ScheduledSequence,
    SchedulerOutput,
)
from pagedinfer.engine.request import Request, RequestStatus
from pagedinfer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedinfer.engine.core.scheduler import Scheduler


def is_plain_greedy(params: SamplingParams) -> bool:
    """The default `may_ride`: greedy requests only (SpeculativeDecoder.may_ride_chain is the
    engine's: history-free sampling where its chains sample)."""
    return params.is_plain_greedy


def plan_spec_lookahead(
    scheduler: Scheduler,
    prev: SchedulerOutput,
    k: int,
    max_device_steps: int = 1,
    reserve_drafts: Callable[..., Callable[[], None] | None] | None = None,
    may_chain: Callable[[list], bool] | None = None,
    may_ride: Callable[[SamplingParams], bool] = is_plain_greedy,
    tokens_per_step: Callable[[int], float] | None = None,
    tokens_to_stop: Callable[[Request, SamplingRow, int], int | None] | None = None,
) -> SchedulerOutput | None:
    """Chained step N+1 for a launched step N (`prev`), or None: up to `max_device_steps` device
    steps of K drafts a sequence, each fed by the one before.

    `reserve_drafts(seq_ids, starts, ends, known)` (where N's inputs start and end; `known`: per
    sequence, its tokens [0, end) where N verified no drafts of it, all real (a prompt admitted at
    N, a sequence that drafted nothing), else None): a draft model drafts the step at launch (one
    device step); it reserves its own cache for the step (catching up the sequences with known
    tokens first) and returns an undo, or None (no chain).

    Waiting requests the synchronous step would admit are admitted into the chained step behind
    its chained rows (prefill chunks with real inputs; one device step), where they may ride
    (`may_join` with `may_ride`, the sampling a chained step can decide on the device, and
    `may_chain(running)` after them: the chain's capacity and policy); else the
    chain ends, and the synchronous step admits them.

    `tokens_per_step(seq_id)`: the tokens a device step is expected to emit for a sequence. With
    it, the device steps stop at the expected end of the sequence that runs longest (its
    max_tokens, or where `tokens_to_stop(seq, row, horizon)` expects a stop token): a device step
    past every sequence's end still costs a whole step, and the host learns of the end only
    after the launch's last step (a launch planned behind one that ends the request runs whole)."""
    if not prev.sequences or prev.preempted_seq_ids or scheduler.pending_copies:
        return None
    if not scheduler.running or len(prev.sequences) < len(scheduler.running):
        return None  # (nothing runs any more: N's sequences all stopped)
    if scheduler.may_preempt_for_priority():
        return None
    admitting = _may_admit(scheduler, k)  # into the step, behind the chained rows (one device step)
    by_seq_id = scheduler.by_seq_id
    running = RequestStatus.RUNNING
    max_len = scheduler.max_model_len
    q = k + 1
    steps = max_device_steps
    needed = 0  # device steps the longest-running sequence is expected to need (capped by steps)
    seqs = []
    ends: list[int] = []  # N's inputs end here: N+1's first position if all its drafts survive
    kept: list[int] = []  # N's rows that continue (none for a sequence that stopped or will at N)
    num_live = 0  # N's sequences still running: every running sequence must be one of them
    for i, s in enumerate(prev.sequences):
        row = s.sample
        if row is None or s.fork_rows:
            return None
        seq = by_seq_id.get(s.seq_id)
        if seq is None or seq.is_finished:
            continue  # stopped after N was planned: its row in N is dropped, the chain goes on
        if seq.status is not running or seq.pending_children:
            return None
        if seq.spec_token_ids and len(seq.spec_token_ids) != s.num_spec_tokens:
            return None  # drafts for a later step (N's own are fine: update clears them)
        end = s.num_computed_tokens + len(s.token_ids)
        if seq.num_kv_tokens != end or seq.num_computed_tokens != s.num_computed_tokens:
            return None  # N's tokens already applied, or KV reserved beyond N's inputs
        num_live += 1
        # Room in the context, and no device step that starts past max_tokens for certain (each
        # device step emits >= 1 token, N's included).
        room = (max_len - end) // q
        if room < 1:
            return None  # no room in the context for a verification: the synchronous step decides
        max_tokens = row.sampling_params.max_tokens
        left = None  # tokens it may still emit from N's first device step on, as far as known
        if max_tokens is not None:
            left = max_tokens - row.output_position  # before N's device steps
            room = min(room, left - prev.num_device_steps)
            if room < 1:
                continue  # it reaches max_tokens at N for certain: no row
        if tokens_per_step is None:
            needed = max_device_steps
        else:
            if tokens_to_stop is not None and max_device_steps > max(needed, 1):  # (else no use)
                stop = tokens_to_stop(seq, row, (prev.num_device_steps + max_device_steps) * q)
                if stop is not None:
                    left = stop if left is None else min(left, stop)
            if left is None:
                needed = max_device_steps
            else:
                per_step = tokens_per_step(seq.seq_id)
                needed = max(needed, math.ceil((left - prev.num_device_steps * per_step) / per_step))
        steps = min(steps, room)
        seqs.append(seq)
        ends.append(end)
        kept.append(i)
    if not seqs or num_live != len(scheduler.running):
        return None  # nothing continues, or a running sequence N does not hold
    # At least one: expected to end within N, a sequence may still need a step (no host pass
    # in between: a chain of one step costs less than the wait for N's tokens).
    steps = min(steps, max(1, needed))
    budget = scheduler.config.max_num_batched_tokens
    if len(seqs) * q > budget:
        return None  # over the step's token budget (the input buffers): the synchronous step splits
    if admitting and budget - len(seqs) * q < scheduler.admission_reserve(budget, own=len(seqs)):
        return None  # drafts would take what the synchronous step leaves the admission
    if admitting:
        steps = 1  # (the admitted prompts' rows are in the first device step only)
    seq_ids = [seq.seq_id for seq in seqs]
    undo_drafts = None
    if reserve_drafts is not None:
        steps = 1  # (the draft steps run between device steps: one a launch)
        starts = [prev.sequences[i].num_computed_tokens for i in kept]
        known = [
            _known_tokens(seq, prev.sequences[i], end) for seq, i, end in zip(seqs, kept, ends, strict=True)
        ]
        undo_drafts = reserve_drafts(seq_ids, starts, ends, known)
        if undo_drafts is None:
            return None
    admitted: list[ScheduledSequence] = []
    if admitting:  # first dibs on blocks, as in the synchronous step (whose drafts also take KV)
        try:
            scheduler.admit_waiting(budget - len(seqs) * q, admitted)
        except BaseException:
            _unadmit(scheduler, admitted, undo_drafts)
            raise
        if (
            not admitted
            or not may_join(scheduler, admitted, may_ride)
            or (may_chain and not may_chain(scheduler.running))
        ):
            _unadmit(scheduler, admitted, undo_drafts)
            return None  # the synchronous step admits (and decides how to sample) instead
    reserve = steps * q  # KV placeholders a sequence: every draft of every device step survives
    copies = scheduler.kv.append_batch(
        seq_ids, [PLACEHOLDER_TOKEN_ID] * (len(seq_ids) * reserve), [reserve] * len(seq_ids)
    )
    if copies is None:
        _unadmit(scheduler, admitted, undo_drafts)
        return None  # out of blocks: the synchronous step decides whom to preempt
    planned: list[ScheduledSequence] = []
    for seq, i, end in zip(seqs, kept, ends, strict=True):
        s = prev.sequences[i]
        seq.num_kv_tokens += reserve
        row = s.sample
        next_row = SamplingRow(
            seq.seq_id,
            row.sampling_params,
            row.seed,
            row.output_position + 1,
            row.prompt_token_ids,
            row.output_token_ids,
        )
        inputs = [PLACEHOLDER_TOKEN_ID] * reserve
        planned.append(ScheduledSequence(seq.seq_id, inputs, end, s.num_prompt_tokens, reserve - 1, next_row))
    # The last device step's rows if every draft survives: its block tables cover every position
    # any device step can take, its context lengths bound theirs. The rows themselves are
    # computed on the device from the token histories (DeviceNgramChain.feed).
    # Admitted prompts follow with their real inputs (rows the feed leaves alone).
    layout = scheduler.kv.build_batch(
        [*seq_ids, *(a.seq_id for a in admitted)],
        [*(e + reserve - q for e in ends), *(a.num_computed_tokens for a in admitted)],
        [*([q] * len(seq_ids)), *(len(a.token_ids) for a in admitted)],
    )
    rows = None if len(kept) == len(prev.sequences) and not admitted else kept
    return SchedulerOutput(
        planned + admitted,
        layout,
        copies,
        [],
        feeds_previous=True,
        feed_rows=rows,
        feeds_drafts=True,
        num_device_steps=steps,
        model_drafts=reserve_drafts is not None,
    )


def resolve_spec_lookahead(
    scheduler: Scheduler, lookahead: SchedulerOutput, result: ModelRunnerOutput
) -> None:
    """After step N's update: N+1's sequences get their real inputs and computed counts, their
    KV records N+1's inputs in place of the placeholders, and the reservation shrinks to them.

    With several device steps only the first one's inputs are known now; the rest stay
    placeholders until N+1's own update records what its device steps consumed
    (`StepUpdate._record_device_inputs`, core/scheduler_update.py)."""
    by_seq_id = scheduler.by_seq_id
    running = RequestStatus.RUNNING
    kv = scheduler.kv
    drafts = {st.seq_id: d for st, d in zip(result.sampled, result.next_drafts or (), strict=True)}
    bonus = {st.seq_id: st.token_ids[-1] for st in result.sampled}
    for s in lookahead.sequences[: lookahead.num_fed]:  # (prompts it admitted have real inputs)
        seq = by_seq_id.get(s.seq_id)
        if seq is None or seq.status is not running:
            continue  # stopped or aborted at N: its N+1 result is dropped by update()
        # (a draft model's drafts are known once N+1 emits: `StepUpdate._record_device_inputs`)
        known = [bonus[s.seq_id]] if lookahead.model_drafts else [bonus[s.seq_id], *drafts[s.seq_id]]
        start = seq.num_computed_tokens  # after N's update: what N's inputs left computed
        s.token_ids[: len(known)] = known
        s.num_computed_tokens = start
        s.sample.output_position = len(seq.output_token_ids)
        end = start + len(s.token_ids)
        kv.set_tokens(s.seq_id, start, known)
        if seq.num_kv_tokens > end:
            scheduler.pending_copies += kv.truncate(s.seq_id, end)
        seq.num_kv_tokens = end


def may_join(
    scheduler: Scheduler,
    admitted: list[ScheduledSequence],
    may_ride: Callable[[SamplingParams], bool] = is_plain_greedy,
) -> bool:
    """Whether prompts admitted into a chained step may ride in it: the device decides their first
    token like every chained row's (`may_ride`: history-free sampling where the chain samples,
    else plain greedy; no logprobs; speculating), and none forks."""
    for a in admitted:
        seq = scheduler.by_seq_id[a.seq_id]
        p = seq.sampling_params
        if seq.pending_children or not (may_ride(p) and p.logprobs is None and p.use_speculation):
            return False
    return True


def _unadmit(scheduler: Scheduler, admitted: list[ScheduledSequence], undo_drafts) -> None:
    """Undo a planned chained step's admissions (back to the queue, in order) and its draft
    reservation: nothing of it was launched."""
    by_seq_id = scheduler.by_seq_id
    for a in reversed(admitted):
        scheduler.unadmit(by_seq_id[a.seq_id])
    if undo_drafts is not None:
        undo_drafts()


def _known_tokens(seq, s: ScheduledSequence, end: int) -> list[int] | None:
    """A sequence's tokens [0, end) when its step N verified no drafts (N's inputs are then all
    real tokens the host has: a prompt, a recomputation, one decode token), else None."""
    if s.num_spec_tokens:
        return None
    tokens = [*seq.prompt_token_ids, *seq.output_token_ids]
    return tokens if len(tokens) == end else None


def _may_admit(scheduler: Scheduler, k: int) -> bool:
    """A waiting request the synchronous scheduler could seat and give blocks (the chained step
    then tries to admit it, else ends); one that fits no free blocks cannot be admitted by either.
    Blocks the chain holds past what a synchronous step needs (its reservations for drafts not yet
    verified) count as free: ending the chain releases them."""
    if not scheduler.waiting or scheduler.num_seats_taken() >= scheduler.config.max_num_seqs:
        return False
    kv = scheduler.kv
    blocks = kv.blocks_for_tokens
    reserved = sum(
        max(blocks(seq.num_kv_tokens) - blocks(seq.num_computed_tokens + 1 + k), 0)
        for seq in scheduler.running
    )
    free = kv.num_free_blocks + reserved
    return any(kv.blocks_to_admit(r.num_tokens) <= free for r in scheduler.waiting)
