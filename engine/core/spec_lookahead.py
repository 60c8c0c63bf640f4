"""Chained speculative steps: plan step N+1 of an n-gram batch before step N's acceptance is known.

Step N (launched, acceptance decided on the device: spec_decode/device_chain.py) verified K_N
drafts per sequence; N+1 verifies K new drafts after N's bonus token. The host does not know
how many of N's drafts survive, so it plans N+1 for the case that all did (positions, context
lengths, slots: an upper bound) and reserves KV for it: K + 1 placeholder slots past N's. The
device moves each sequence's inputs back by its rejected drafts (`DeviceNgramChain.feed`).

Once N's tokens are applied (`Scheduler.update` leaves the KV of these sequences alone), the
placeholders become N+1's real inputs and the KV reservation shrinks to N+1's own extent:
`resolve_spec_lookahead`. N+1 is then an ordinary record of what ran, and the next step is
planned from it the same way.

A chain continues N's batch unchanged: every running sequence was in N, samples there, and is
all-greedy (the device decides by argmax); nothing can be preempted or admitted; each sequence
has room for N+1 in its context and max_tokens. Anything else (a sequence that stopped, a
waiting request that could be admitted) ends the chain: the next step is scheduled
synchronously, with drafts from the host proposer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedinfer.engine.core.lookahead import PLACEHOLDER_TOKEN_ID, _may_preempt
from pagedinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SamplingRow,
    ScheduledSequence,
    SchedulerOutput,
)
from pagedinfer.engine.request import RequestStatus

if TYPE_CHECKING:
    from pagedinfer.engine.core.scheduler import Scheduler


def plan_spec_lookahead(scheduler: Scheduler, prev: SchedulerOutput, k: int) -> SchedulerOutput | None:
    """Chained step N+1 (K drafts a sequence) for a launched step N (`prev`), or None."""
    if not prev.sequences or prev.preempted_seq_ids or scheduler._pending_copies:
        return None
    if len(prev.sequences) != len(scheduler.running) or _may_preempt(scheduler) or _may_admit(scheduler):
        return None
    by_seq_id = scheduler._by_seq_id
    running = RequestStatus.RUNNING
    max_len = scheduler.max_model_len
    planned: list[ScheduledSequence] = []
    seq_ids: list[int] = []
    ends: list[int] = []  # N's inputs end here: N+1's first position if all its drafts survive
    seqs = []
    for s in prev.sequences:
        row = s.sample
        if row is None or s.fork_rows:
            return None
        seq = by_seq_id.get(s.seq_id)
        if seq is None or seq.status is not running or seq.pending_children:
            return None
        if seq.spec_token_ids and len(seq.spec_token_ids) != s.num_spec_tokens:
            return None  # drafts for a later step (N's own are fine: update clears them)
        end = s.num_computed_tokens + len(s.token_ids)
        if seq.num_kv_tokens != end or seq.num_computed_tokens != s.num_computed_tokens:
            return None  # N's tokens already applied, or KV reserved beyond N's inputs
        params = row.sampling_params
        max_tokens = params.max_tokens
        if end + k + 1 > max_len or (max_tokens is not None and row.output_position + 1 >= max_tokens):
            return None  # no room for N+1, or the sequence ends at N for certain
        next_row = SamplingRow(
            seq.seq_id, params, row.seed, row.output_position + 1, row.prompt_token_ids, row.output_token_ids
        )
        planned.append(
            ScheduledSequence(
                seq.seq_id,
                [PLACEHOLDER_TOKEN_ID] * (k + 1),
                end,
                s.num_prompt_tokens,
                k,
                next_row,
            )
        )
        seqs.append(seq)
        seq_ids.append(seq.seq_id)
        ends.append(end)
    copies = scheduler.kv.append_batch(
        seq_ids, [PLACEHOLDER_TOKEN_ID] * (len(seq_ids) * (k + 1)), [k + 1] * len(seq_ids)
    )
    if copies is None:
        return None  # out of blocks: the synchronous step decides whom to preempt
    for seq in seqs:
        seq.num_kv_tokens += k + 1
    # N+1's rows if all of N's drafts survive: K + 1 positions right after N's inputs (the block
    # tables then cover every position N+1 can take).
    layout = scheduler.kv.build_batch(seq_ids, ends, [k + 1] * len(seq_ids))
    return SchedulerOutput(planned, layout, copies, [], feeds_previous=True, feeds_drafts=True)


def resolve_spec_lookahead(
    scheduler: Scheduler, lookahead: SchedulerOutput, result: ModelRunnerOutput
) -> None:
    """After step N's update: N+1's sequences get their real inputs and computed counts, their
    KV records N+1's inputs in place of the placeholders, and the reservation shrinks to them."""
    by_seq_id = scheduler._by_seq_id
    running = RequestStatus.RUNNING
    kv = scheduler.kv
    drafts = {st.seq_id: d for st, d in zip(result.sampled, result.next_drafts or (), strict=True)}
    bonus = {st.seq_id: st.token_ids[-1] for st in result.sampled}
    for s in lookahead.sequences:
        seq = by_seq_id.get(s.seq_id)
        if seq is None or seq.status is not running:
            continue  # stopped or aborted at N: its N+1 result is dropped by update()
        inputs = [bonus[s.seq_id], *drafts[s.seq_id]]
        start = seq.num_computed_tokens  # after N's update: what N's inputs left computed
        s.token_ids = inputs
        s.num_computed_tokens = start
        s.sample.output_position = len(seq.output_token_ids)
        end = start + len(inputs)
        kv.set_tokens(s.seq_id, start, inputs)
        if seq.num_kv_tokens > end:
            scheduler._pending_copies += kv.truncate(s.seq_id, end)
        seq.num_kv_tokens = end


def _may_admit(scheduler: Scheduler) -> bool:
    """A waiting request the synchronous scheduler could seat and give blocks (a chain would keep
    it waiting); one that fits no free blocks cannot be admitted by either."""
    if not scheduler.waiting or scheduler._num_seats_taken() >= scheduler.config.max_num_seqs:
        return False
    kv = scheduler.kv
    free = kv.num_free_blocks - kv.watermark_blocks
    return any(kv.blocks_for_tokens(r.num_tokens) <= free for r in scheduler.waiting)
