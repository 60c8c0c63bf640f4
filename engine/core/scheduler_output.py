"""Typed messages of one step: scheduler -> model runner -> scheduler. No torch here."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from pagedinfer.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class BatchLayout:
    """Flat attention inputs of one step, built by the KV manager (all numpy int32).

    B = number of scheduled sequences, T = total new tokens, M = max blocks per sequence.
    """

    block_tables: np.ndarray  # [B, M]
    slot_mapping: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    context_lens: np.ndarray  # [B] tokens in the cache after this step (computed + new)
    query_start_loc: np.ndarray  # [B + 1]


# The per-sequence messages below are built ~1,000 times a step at batch 256: plain slotted
# dataclasses (a frozen one's __init__ costs ~3x). Treat them as read-only all the same.
@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to pick one sequence's next token(s)."""

    seq_id: int
    sampling_params: SamplingParams
    seed: int | None  # None: the device RNG; else counter-based, batch-independent draws
    output_position: int  # index among the outputs of the (first) token sampled this step
    prompt_token_ids: list[int]  # references, read-only: used by the penalties
    output_token_ids: list[int]


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of the step.

    `token_ids` are the inputs computed this step: a prefill chunk, the last sampled token
    (decode), or the last sampled token plus draft tokens (speculative verification).
    `sample` is None while a prompt chunk does not reach the end of the known tokens.
    """

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int  # before this step
    num_prompt_tokens: int = 0
    num_spec_tokens: int = 0  # trailing draft tokens among token_ids
    sample: SamplingRow | None = None
    fork_rows: tuple[SamplingRow, ...] = ()  # n > 1 children sampled from the same logits
    # prompt_logprobs: the prompt tokens this chunk's leading inputs predict (input j predicts
    # prompt token num_computed_tokens + j + 1), and how many alternatives each; None: not asked
    prompt_targets: list[int] | None = None
    num_prompt_logprobs: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the model runner needs for one step."""

    sequences: list[ScheduledSequence]  # batch order
    layout: BatchLayout | None  # None when nothing is scheduled
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # COW (src, dst) blocks
    preempted_seq_ids: list[int] = field(default_factory=list)
    # A lookahead step (core/lookahead.py): each continuing sequence's one input is the token it
    # sampled in the step before, fed on the device; `token_ids` hold placeholders until it is
    # resolved. Those fed sequences come first; requests admitted by the lookahead follow them.
    feeds_previous: bool = False
    feed_rows: list[int] | None = None  # the row of that step's samples each fed sequence takes; None: i
    # A fed sequence has a grammar: its mask needs the step before's token on the host, so the
    # step's forward is launched ahead but its sampling only once that step's tokens are applied.
    defers_sampling: bool = False
    # A chained speculative step (core/spec_lookahead.py): every sequence's inputs (the bonus token
    # + K drafts) and positions come from the step before, on the device. It runs
    # `num_device_steps` such verification steps back to back, each fed by the one before, and is
    # planned and applied as one: each sequence's `token_ids` are placeholders for all of their
    # inputs (num_device_steps * (K + 1)); the layout holds K + 1 rows a sequence, those of the
    # last device step if every draft survives (block tables covering every device step).
    feeds_drafts: bool = False
    num_device_steps: int = 1
    # A chained step whose drafts a draft model makes on the device at launch, from the step
    # before's acceptance: the host learns the ids it verified from what it emits.
    model_drafts: bool = False

    @property
    def num_fed(self) -> int:
        """How many leading sequences take their input from the step before (0: none)."""
        if not self.feeds_previous:
            return 0
        return len(self.feed_rows) if self.feed_rows is not None else len(self.sequences)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences

    @property
    def is_pure_decode(self) -> bool:
        return bool(self.sequences) and all(s.num_new_tokens == 1 for s in self.sequences)


@dataclass(frozen=True)
class TokenLogprobs:
    """Raw logprobs at one position (token strings are added by the detokenizer)."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens start + 1 .. start + len(entries) (prompt_logprobs)."""

    seq_id: int
    start: int  # the input position of the first entry (its target is the next token)
    entries: list[TokenLogprobs]


@dataclass(slots=True)
class SampledTokens:
    """Tokens a sequence gained this step: one normally, 1 + accepted drafts when verifying."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class ModelRunnerOutput:
    """Result of one step: sampled tokens per sequence (children of a fork included)."""

    sampled: list[SampledTokens]
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verified_seqs: int = 0  # sequences whose drafts were verified this step
    # A step whose acceptance was decided on the device (spec_decode/device_chain.py): per sampled
    # sequence, the drafts its next (chained) step verifies.
    next_drafts: list[list[int]] | None = None
    verified_drafts: list[int] | None = None  # per sampled sequence: drafts verified (filler: 0)
    # Several device steps (SchedulerOutput.num_device_steps): per sampled sequence, each step's
    # (drafts verified, tokens emitted); `verified_drafts` then holds their sums.
    device_steps: list[list[tuple[int, int]]] | None = None
    gpu_time_s: float = 0.0  # device time of the forward + sampling, when measured
    prompt_logprobs: list[PromptLogprobs] | None = None  # chunks of prompts that asked for them

    def verifications(self, applied: dict[int, int] | None = None) -> list[tuple[int, int, int, int]]:
        """A device-decided step's verifications as (seq_id, drafts, accepted, emitted), filler
        included, in the order their tokens were emitted (emitted: the tokens of it that stand).

        `applied`: tokens the scheduler applied per sequence; sequences absent from it count no
        verification, and with several device steps a sequence counts only those that started
        before its applied tokens ended (it stopped, or it had stopped the step before). A
        verification whose sequence ended inside its accepted drafts (max_tokens, EOS, a stop id)
        counts the draft positions up to the end only (`within_end`)."""
        out = []
        for b, st in enumerate(self.sampled):
            limit = len(st.token_ids) if applied is None else applied.get(st.seq_id, 0)
            steps = (
                self.device_steps[b]
                if self.device_steps is not None
                else [(self.verified_drafts[b], len(st.token_ids))]
            )
            out.extend((st.seq_id, *v) for v in verifications_within(steps, limit))
        return out


def verifications_within(
    verifications: Iterable[tuple[int, int]], kept: int
) -> Iterator[tuple[int, int, int]]:
    """(drafts, accepted, emitted) of a sequence's verifications, given as (drafts, tokens emitted)
    in emission order, of which only the first `kept` tokens stand: each cut by
    `verification_within_end`, and those past the kept tokens left out."""
    for drafts, emitted in verifications:
        if kept <= 0:
            break
        yield verification_within_end(drafts, emitted, kept)
        kept -= emitted


def verification_within_end(drafts: int, emitted: int, kept: int) -> tuple[int, int, int]:
    """(drafts, accepted, emitted) of a verification that emitted `emitted` tokens (its accepted
    drafts and one more) of which only `kept` stand: `within_end`, and the tokens that stand."""
    return (*within_end(drafts, emitted - 1, kept), min(emitted, kept))


def within_end(drafts: int, accepted: int, kept: int) -> tuple[int, int]:
    """(drafts, accepted) of a verification of which only `kept` tokens stand (its tokens are its
    accepted drafts and one more): where the sequence ended inside the accepted drafts, the
    positions past its end count neither as drafted nor as accepted (truncation is no rejection:
    the target accepted them), else unchanged."""
    return (kept, kept) if kept <= accepted else (drafts, accepted)


@dataclass
class StepStats:
    """Per-step counters for metrics listeners (Prometheus, tracing)."""

    step: int
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    num_finished: int
    num_draft_tokens: int
    num_accepted_tokens: int
    kv_cache_usage: float
    step_time_s: float = 0.0
    batch_size: int = 0
    num_verified_seqs: int = 0  # speculating sequences verified this step (mean accepted length)
    # per draft position i (0: the first draft token): drafts verified there and accepted there
    draft_tokens_per_position: tuple[int, ...] = ()
    accepted_tokens_per_position: tuple[int, ...] = ()


@dataclass(slots=True)
class SequenceUpdate:
    """What one sequence gained in a step, for the output processor (detokenizer, streams)."""

    seq_id: int
    request_id: str
    index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    is_finished: bool = False
    # speculation this step: (draft tokens verified, accepted) per verification, in the order
    # their tokens (accepted drafts + 1) are in new_token_ids (None: none; no list per update
    # on the plain decoding path)
    verifications: list[tuple[int, int]] | None = None
    # prompt_logprobs: every prompt token's after the first, sent once with the first output token
    prompt_logprobs: list[TokenLogprobs] | None = None
