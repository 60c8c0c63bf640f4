"""Asynchronous scheduling: plan and launch step N+1 while step N still runs on the device.

A lookahead step repeats step N's batch with every sequence one token further. The token each
sequence samples at N is not on the host yet, so its KV slot is reserved under a placeholder id,
the model runner feeds N's sampled ids to N+1 on the device, and `resolve_lookahead` writes the
real ids into the KV manager once N's tokens have been applied (before that block can be
prefix-cached). The host's per-step work (update, schedule, input staging) then overlaps the
device's forward pass instead of sitting between two of them.

A lookahead continues step N's batch (in N's row order) only where the synchronous scheduler
would too: every running sequence was in step N, sampled there, and continues with one plain
decode token; nothing can be preempted; no drafts, forks, penalties (which read the output
history on the host) or logprobs (their host copy would wait for N+1). A sequence with a grammar
(structured output) rides too, but its mask needs N's token on the host: such a step is launched
in two parts, its forward behind N at once and its sampling (mask fill included) once N's tokens
are applied (`defers_sampling`), so the forward still overlaps the host's work. A sequence certain to
finish at N (max_tokens or the context length reached) gets no row. One that stops at N on a
sampled token (EOS, stop ids) computes one token at N+1 that is discarded; its KV slot went back
with its blocks, and the stream order puts N+1's write before any later owner's. And a sequence
that stopped after N was planned (its stop applied since: a stop token, a stop string, an abort)
still has a row in N but gets none in N+1: without that, every unforeseeable stop in a batch made
the step after it synchronous.

Waiting requests are admitted into the lookahead behind the continuing sequences, as the
synchronous step would admit them (its queue order, token budget, seats and KV blocks), except
that the seats and blocks of sequences finishing at N are not free yet: those go to the next
step. Without that, a workload with a queue (an offline batch: a sequence ends and one is
admitted almost every step) would plan nearly every step synchronously, with the device idle
while the host updates, schedules and stages. A request of higher priority than a running one
keeps the step synchronous (it may preempt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedinfer.engine.core.scheduler_output import SamplingRow, ScheduledSequence, SchedulerOutput
from pagedinfer.engine.request import RequestStatus

if TYPE_CHECKING:
    from pagedinfer.engine.core.scheduler import Scheduler

PLACEHOLDER_TOKEN_ID = 0  # a valid id: never fed to the model (the device feed replaces it)


def plan_lookahead(scheduler: Scheduler, prev: SchedulerOutput) -> SchedulerOutput | None:
    """Step N+1 for a launched step N (`prev`) whose tokens are not applied yet, or None."""
    if not prev.sequences or prev.preempted_seq_ids or scheduler.pending_copies:
        return None
    if (
        not scheduler.running
        or len(prev.sequences) < len(scheduler.running)
        or scheduler.may_preempt_for_priority()
    ):
        return None  # (nothing runs any more: N's sequences all stopped)
    by_seq_id = scheduler.by_seq_id
    running = RequestStatus.RUNNING
    max_len = scheduler.max_model_len
    planned: list[ScheduledSequence] = []
    feed_rows: list[int] = []  # the row of N's samples each planned sequence takes
    seqs = []
    num_live = 0  # N's sequences still running: every running sequence must be one of them
    defers_sampling = False
    for i, s in enumerate(prev.sequences):
        row = s.sample
        if row is None or s.num_spec_tokens or s.fork_rows:
            return None
        seq = by_seq_id.get(s.seq_id)
        if seq is None or seq.is_finished:
            continue  # stopped after N was planned (a stop token, a stop string, an abort)
        if seq.status is not running or seq.spec_token_ids or seq.pending_children:
            return None
        num_live += 1
        params = row.sampling_params
        if params.logprobs is not None or params.has_penalties:
            return None
        position = s.num_computed_tokens + len(s.token_ids)  # where N's sampled token goes
        if seq.num_kv_tokens != position or seq.num_computed_tokens != s.num_computed_tokens:
            return None  # N's tokens already applied, or KV reserved beyond N's inputs
        max_tokens = params.max_tokens
        if position + 1 >= max_len or (max_tokens is not None and row.output_position + 1 >= max_tokens):
            continue  # finishes at N for certain: no row, no KV slot
        next_row = SamplingRow(
            seq.seq_id,
            params,
            row.seed,
            row.output_position + 1,
            row.prompt_token_ids,
            row.output_token_ids,
        )
        planned.append(
            ScheduledSequence(
                seq.seq_id, [PLACEHOLDER_TOKEN_ID], position, len(seq.prompt_token_ids), 0, next_row, ()
            )
        )
        seqs.append(seq)
        feed_rows.append(i)
        defers_sampling = defers_sampling or params.structured_output is not None
    if num_live != len(scheduler.running) or not planned:
        return None  # a running sequence N does not hold, or nothing continues
    seq_ids = [s.seq_id for s in planned]
    copies = scheduler.kv.append_batch(seq_ids, [PLACEHOLDER_TOKEN_ID] * len(seq_ids), [1] * len(seq_ids))
    if copies is None:
        return None  # out of blocks: the synchronous step decides whom to preempt
    for seq in seqs:
        seq.num_kv_tokens += 1
    num_fed = len(planned)
    try:
        scheduler.admit_waiting(scheduler.config.max_num_batched_tokens - num_fed, planned)
        layout = scheduler.kv.build_batch(
            [s.seq_id for s in planned],
            [s.num_computed_tokens for s in planned],
            [s.num_new_tokens for s in planned],
        )
    except BaseException:  # nothing is in flight yet: undo the slots and admissions made so far
        partial = SchedulerOutput(planned, None, copies, feeds_previous=True, feed_rows=feed_rows)
        drop_lookahead(scheduler, partial)
        raise
    rows = None if len(feed_rows) == len(planned) == len(prev.sequences) else feed_rows
    return SchedulerOutput(
        planned, layout, copies, [], feeds_previous=True, feed_rows=rows, defers_sampling=defers_sampling
    )


def resolve_lookahead(scheduler: Scheduler, lookahead: SchedulerOutput) -> None:
    """After step N's update: the placeholders of step N+1 become the tokens N sampled."""
    by_seq_id = scheduler.by_seq_id
    running = RequestStatus.RUNNING
    seq_ids: list[int] = []
    token_ids: list[int] = []
    for s in lookahead.sequences[: lookahead.num_fed]:  # the admitted ones have real inputs
        seq = by_seq_id.get(s.seq_id)
        if seq is None or seq.status is not running:
            continue  # stopped or aborted at N: its N+1 result is dropped by update()
        token = seq.output_token_ids[-1]
        s.token_ids[0] = token  # the step's record of its inputs
        seq_ids.append(s.seq_id)
        token_ids.append(token)
    if seq_ids:
        scheduler.kv.set_last_tokens(seq_ids, token_ids)


def drop_lookahead(scheduler: Scheduler, lookahead: SchedulerOutput) -> None:
    """A launched lookahead that will never be collected (its step or the one before failed):
    give back its KV slots so the synchronous scheduler starts from N's state, and owe its
    copy-on-write copies again (re-copying a shared block's prefix is idempotent) in case they
    never ran."""
    by_seq_id = scheduler.by_seq_id
    running = RequestStatus.RUNNING
    kv = scheduler.kv
    copies: list[tuple[int, int]] = []
    owned: set[int] = set()  # blocks of the sequences kept: only their copies are owed again
    for s in lookahead.sequences[lookahead.num_fed :]:  # admitted by the lookahead: back to the queue
        seq = by_seq_id.get(s.seq_id)
        if seq is not None and seq.status is running:
            scheduler.unadmit(seq)
    for s in lookahead.sequences[: lookahead.num_fed]:
        seq = by_seq_id.get(s.seq_id)
        if seq is None or seq.status is not running:
            continue  # finished: its blocks are gone
        # A chained speculative step (core/spec_lookahead.py) reserved KV past drafts that may not
        # survive: back to what the sequence has computed, whether N's update ran or not.
        keep = seq.num_computed_tokens if lookahead.feeds_drafts else s.num_computed_tokens
        if seq.num_kv_tokens <= keep:
            continue  # already given back
        copies += kv.truncate(s.seq_id, keep)
        seq.num_kv_tokens = keep
        owned.update(kv.block_table(s.seq_id))
    scheduler.pending_copies += [c for c in lookahead.block_copies if c[1] in owned] + copies
