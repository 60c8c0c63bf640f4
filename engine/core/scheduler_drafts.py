"""How drafts share a step's token budget and KV blocks with prompt work: per running sequence,
the budget its drafts leave to the prompt chunks after it and to the next admission, as plain
decoding would give them (drafts are optional; prompt work is not).

A mixin of `Scheduler` (core/scheduler.py), which owns the queues it reads. CPU-only.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedinfer.engine.config import SchedulerConfig
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.request import Request


class DraftReserves:
    """The draft reservations of Scheduler.schedule() and of the chained step's planner."""

    config: SchedulerConfig
    kv: KVCacheManager
    clock: Callable[[], float]
    waiting: list[Request]
    running: list[Request]

    def num_seats_taken(self) -> int:
        raise NotImplementedError  # Scheduler's

    def _num_new_tokens(self, seq: Request, budget: int, later: int = 0, reserved: int = 0) -> int:
        raise NotImplementedError  # Scheduler's

    def _waiting_key(self, now: float) -> Callable[..., tuple]:
        raise NotImplementedError  # Scheduler's

    def _draft_reserves(self, budget: int) -> dict[int, int] | None:
        """Per running sequence (in order), the budget its drafts leave to the prompt work after
        it, beyond the one token of each later sequence: the later prompts' chunks and the
        admission of the next waiting request, as plain decoding would give them; with chunked
        prefill at most `_prompt_share` of it, so that a long prompt does not switch speculation
        off (drafts and the prompt then share what the decodes' own tokens leave). None when no
        sequence has drafts this step (nothing to reserve; the queue is not ranked)."""
        if not any(r.spec_token_ids for r in self.running):
            return None
        head = self._admission_head()
        chunked = self.config.enable_chunked_prefill
        share = self._prompt_share(budget)
        own_tokens = self._own_tokens() if head is not None else 0  # (unused without a head)
        work = self._admission_need(budget, head, own_tokens)
        reserves: dict[int, int] = {}
        for seq in reversed(self.running):
            reserves[seq.seq_id] = min(work, share) if chunked else work
            own = min(seq.num_tokens, self.max_model_len) - seq.num_computed_tokens
            work += max(own - 1, 0)  # (its first token is reserved apart, as every sequence's)
        if head is not None and self._drafts_block(head, budget, reserves, own_tokens):
            return dict.fromkeys(reserves, budget)  # none this step
        return reserves

    def _prompt_share(self, budget: int, own: int | None = None) -> int:
        """With chunked prefill, the most of the budget drafts leave to prompt work: half of what
        one token for each running sequence (`own`, default: as many as run) leaves (1 at least)."""
        return max((budget - (len(self.running) if own is None else own)) // 2, 1)

    def _admission_head(self) -> Request | None:
        """The waiting request admitted next, if it has a seat (None: no waiting request, or
        none for it)."""
        if not self.waiting or self.num_seats_taken() >= self.config.max_num_seqs:
            return None
        head = min(self.waiting, key=self._waiting_key(self.clock()))
        if self.num_seats_taken() + 1 + len(head.pending_children) > self.config.max_num_seqs:
            return None
        return head

    def _own_tokens(self) -> int:
        """The running sequences' own tokens this step (prompt chunks left, decodes' last
        token): what plain decoding schedules before any admission."""
        return sum(max(r.num_tokens - r.num_computed_tokens, 0) for r in self.running)

    def _drafts_block(self, head: Request, budget: int, reserves: dict[int, int], own_tokens: int) -> bool:
        """Whether the KV blocks of this step's drafts would keep `head` out where plain decoding
        admits it: the running sequences' own tokens leave it the budget and room (as
        `KVCacheManager.allocate` counts: the whole prompt, plus the watermark), their own
        tokens plus the drafts the budget gives them (`reserves`) do not. Drafts are reserved
        before admission; with a short pool they kept a request that plain decoding admits
        waiting until a drafting sequence ended (a review, 2026-12-06). Blocks as the step's
        append takes them: copy-on-write copies of shared last blocks included (a fork's first
        tokens, drafts after reserved slots). `own_tokens`: `_own_tokens()`."""
        left = budget - own_tokens
        if (left < 1) if self.config.enable_chunked_prefill else (head.num_tokens > left):
            return False  # plain decoding has no budget for it this step either
        ids: list[int] = []
        own: list[int] = []
        with_drafts: list[int] = []
        left = budget
        num_running = len(self.running)
        for i, r in enumerate(self.running):  # the budget as `_schedule_running` hands it out
            later = num_running - i - 1
            new = self._num_new_tokens(r, left, later, later + reserves[r.seq_id]) if left > 0 else 0
            left -= new
            ids.append(r.seq_id)
            own.append(max(r.num_tokens - r.num_kv_tokens, 0))
            with_drafts.append(max(r.num_computed_tokens + new - r.num_kv_tokens, own[-1]))
        kv = self.kv
        own_blocks = kv.blocks_needed_to_append_batch(ids, own)
        drafts = kv.blocks_needed_to_append_batch(ids, with_drafts) - own_blocks
        room = kv.num_free_blocks - own_blocks
        return room - drafts < kv.blocks_to_admit(head.num_tokens) <= room

    def _admission_need(self, budget: int, head: Request | None, own: int | None = None) -> int:
        """The budget plain decoding would give `head`, the waiting request admitted next,
        after the running sequences' own tokens (`own`, default: what they hold now): its whole
        prompt without chunked prefill (0 if it does not fit), else as much of it as they leave
        (1 at least). 0 without one. The budget held for a request the pool cannot take yet is
        the drafts' loss."""
        if head is None:
            return 0
        left = budget - (self._own_tokens() if own is None else own)
        if not self.config.enable_chunked_prefill:
            return head.num_tokens if head.num_tokens <= left else 0
        return min(head.num_tokens, max(left, 1))

    def admission_reserve(self, budget: int, own: int | None = None) -> int:
        """What drafts of decodes leave to the next admission (`_draft_reserves` with no prompt
        running): a chained speculative step (core/spec_lookahead.py) that would leave less
        declines, and the synchronous step schedules as this scheduler does. `own`: the running
        sequences' own tokens in that step (the chained step plans before its predecessor is
        applied, whose inputs the sequences still hold: one token each, its bonus token)."""
        need = self._admission_need(budget, self._admission_head(), own)
        return min(need, self._prompt_share(budget, own)) if self.config.enable_chunked_prefill else need
