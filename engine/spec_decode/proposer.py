"""What a draft proposer is: drafts up to K tokens for many sequences at once.

A proposer sees every known token of a sequence (prompt + accepted outputs; the last one is
not yet in the target's KV cache) and returns drafts that the target verifies next step. A
proposer with a distribution (a draft model) also returns q, processed with the sequence's
sampling parameters exactly like the target's p; one without (n-gram) returns None: q is then a
point mass on each drafted token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedinfer.engine.core.scheduler_output import SamplingRow


@dataclass(slots=True)  # not frozen: one per drafting sequence per step (a frozen __init__ costs 3x)
class DraftRequest:
    """One sequence to draft for: its tokens live in `row` (prompt_token_ids + output_token_ids)."""

    row: SamplingRow
    # >= 1; already capped by the context length, and by max_tokens except for seeded sampled
    # requests of a proposer that draws its drafts (SpeculativeDecoder._max_drafts says why)
    max_draft_tokens: int
    eos_token_ids: tuple[int, ...] = ()  # for min_tokens bans when processing q like p

    @property
    def seq_id(self) -> int:
        return self.row.seq_id

    @property
    def num_tokens(self) -> int:
        return len(self.row.prompt_token_ids) + len(self.row.output_token_ids)

    def token_ids(self) -> list[int]:
        return [*self.row.prompt_token_ids, *self.row.output_token_ids]


@dataclass
class DeviceDrafts:
    """Drafts that stay on the device (a draft model's, greedy or sampled), written into the verification's
    inputs there (ModelRunner); the host learns them from one copy enqueued after the last draft
    step, by the time the verification is collected."""

    tokens: torch.Tensor  # [R, K] int64 on the device: row r's first counts[r] are its drafts
    rows: dict[int, int]  # seq_id -> row
    counts: list[int]
    host: torch.Tensor  # [R, K] the same on the host (pinned on CUDA), valid once `ready` is done
    ready: torch.cuda.Event | None = None  # None: on the host already
    start: torch.cuda.Event | None = None  # before the first draft step (with `ready`: device time)
    _lists: dict[int, list[int]] | None = None

    def to_host(self) -> dict[int, list[int]]:
        """seq_id -> its drafts (waits for the copy the first time)."""
        if self._lists is None:
            if self.ready is not None:
                self.ready.synchronize()
            rows = self.host.tolist()
            self._lists = {s: rows[r][: self.counts[r]] for s, r in self.rows.items()}
        return self._lists


@dataclass
class DraftProposals:
    """Drafts for each request, in request order; a sequence may get fewer than asked, or none."""

    token_ids: list[list[int]]
    # [B, K, V] fp32 draft distributions (row b valid for its first len(token_ids[b]) positions),
    # or None for a point mass on every drafted token.
    probs: torch.Tensor | None = None
    # Set when the drafts stayed on the device: `token_ids` then hold placeholders (their counts).
    device: DeviceDrafts | None = None


class Proposer(Protocol):
    """Drafts tokens for a batch of sequences. Implementations: NgramProposer, DraftModelProposer."""

    # Whether a sampled request's drafts are draws from a distribution q (a draft model), which
    # rejection sampling may accept in place of the target's own draw; n-gram drafts are not.
    draws_drafts: bool

    def propose(self, requests: Sequence[DraftRequest]) -> DraftProposals:
        """Drafts for every request (all at once: one batched pass where there is a model)."""
        ...

    def free(self, seq_id: int) -> None:
        """Forget a sequence (finished, aborted or preempted); unknown ids are ignored."""
        ...
