"""When to speculate: per engine step (batch size) and per sequence (running acceptance rate).

Speculation pays when decoding is memory-bound: at large batches the K extra verification rows
per sequence cost real compute, so the whole step goes without drafts above `max_batch_size`.
A sequence whose drafts keep being rejected pays K rows for nothing: once its exponentially
averaged per-token acceptance rate (accepted over the draft positions checked up to the first
rejection) falls below `min_acceptance_rate` it pauses, and probes again after
`probe_interval` steps so a sequence that turns repetitive later can benefit again. A pause
takes effect only in steps where no other sequence drafts (SpeculativeDecoder.propose): there it
saves the draft model's steps and the verification; beside drafting sequences it would save
nothing measurable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedinfer.engine.config import SpeculativeConfig


@dataclass
class _SequenceStats:
    # Exponential averages of drafts accepted and draft positions checked per verification; their
    # ratio estimates the per-token acceptance alpha without bias (an average of per-step ratios
    # reads alpha 0.46 at K 4 as ~0.29). Start: ratio 1 (a fresh or probing sequence gets to try)
    # with the weight of ~2 verifications, so one that gets nothing pauses after ~6 (threshold 0.2).
    accepted_ema: float = 0.2
    tried_ema: float = 0.2
    num_observations: int = 0
    paused_steps_left: int = 0
    # Tokens a device step emitted for the sequence (1 + accepted; 1 where it drafted nothing),
    # averaged the same way: how many device steps a chain should plan near max_tokens.
    tokens_ema: float = 0.0
    num_steps_seen: int = 0

    @property
    def acceptance_ema(self) -> float:
        return self.accepted_ema / self.tried_ema


@dataclass
class SpeculationStats:
    """Totals since the engine started (for metrics and benchmarks)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verified_sequences: int = 0  # sequence-steps that verified at least one draft
    num_emitted_tokens: int = 0  # tokens those sequence-steps emitted (accepted + 1 each)
    num_paused_sequence_steps: int = 0  # could have drafted, but the policy had them paused
    # Why a decoding sequence-step had no draft (with the paused ones above: coverage's complement)
    num_unmatched_sequence_steps: int = 0  # asked the proposer, got nothing (n-gram: no match)
    num_capped_sequence_steps: int = 0  # max_tokens or the context left no room for a draft
    num_disabled_sequence_steps: int = 0  # the step ran above max_batch_size

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying sequence-step (1 + accepted drafts on average)."""
        return self.num_emitted_tokens / self.num_verified_sequences if self.num_verified_sequences else 0.0


@dataclass
class SpeculationPolicy:
    """Adaptive on/off decisions; `observe` feeds it each verification's outcome."""

    config: SpeculativeConfig
    ema_decay: float = 0.9  # weight of the history: ~10 verifications dominate
    min_observations: int = 3  # never pause on one or two unlucky steps
    probe_interval: int = 16  # steps a paused sequence waits before trying again
    _seqs: dict[int, _SequenceStats] = field(default_factory=dict)

    def is_step_enabled(self, num_running: int) -> bool:
        return self.config.method is not None and num_running <= self.config.max_batch_size

    def should_speculate(self, seq_id: int) -> bool:
        """Whether this sequence drafts this step (counts down a pause as a side effect)."""
        stats = self._seqs.get(seq_id)
        if stats is None or stats.paused_steps_left == 0:
            return True
        stats.paused_steps_left -= 1
        if stats.paused_steps_left == 0:
            # probe afresh (its tokens a step stay: they describe the steps it rides anyway)
            self._seqs[seq_id] = _SequenceStats(
                tokens_ema=stats.tokens_ema, num_steps_seen=stats.num_steps_seen
            )
            return True
        return False

    def is_paused(self, seq_id: int) -> bool:
        stats = self._seqs.get(seq_id)
        return stats is not None and stats.paused_steps_left > 0

    def observe(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """One step's outcome for a sequence: drafts verified (0: it drafted nothing, e.g. an
        unmatched n-gram) and how many were accepted."""
        stats = self._seqs.setdefault(seq_id, _SequenceStats())
        emitted = num_accepted + 1
        stats.tokens_ema = (
            emitted
            if stats.num_steps_seen == 0
            else self.ema_decay * stats.tokens_ema + (1 - self.ema_decay) * emitted
        )
        stats.num_steps_seen += 1
        if num_drafts <= 0:
            return
        # Per-token acceptance, independent of K: drafts are checked in order up to the first
        # rejection, so accepted + (1 if one was rejected) positions were tried (accepted / K would
        # read alpha 0.46 at K 4 as 0.2 and pause sequences that pay).
        tried = num_accepted + (1 if num_accepted < num_drafts else 0)
        decay = self.ema_decay
        stats.accepted_ema = decay * stats.accepted_ema + (1 - decay) * num_accepted
        stats.tried_ema = decay * stats.tried_ema + (1 - decay) * tried
        stats.num_observations += 1
        if stats.acceptance_ema >= self.config.min_acceptance_rate:
            stats.paused_steps_left = 0  # recovered while riding along: no need to sit it out
        elif stats.num_observations >= self.min_observations:
            stats.paused_steps_left = self.probe_interval

    def tokens_per_step(self, seq_id: int, k: int) -> float:
        """Expected tokens a verification step emits for the sequence: its recent average, or
        K + 1 before it has one (optimistic: a chain then plans the fewest device steps)."""
        stats = self._seqs.get(seq_id)
        if stats is None or stats.num_steps_seen == 0:
            return float(k + 1)
        return max(1.0, stats.tokens_ema)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
