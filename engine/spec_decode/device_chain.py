"""N-gram speculation chained on the device: each step's acceptance and the next step's drafts are
decided where the logits are, so step N+1 is launched before step N's tokens reach the host.

Why: with the host deciding, a speculative step waits for its verification, then the host
accepts, proposes and stages the next one while the device idles; for a small model whose
step is host- and launch-bound that idle time is most of a plain step (bench/NOTES.md,
speculative n-gram). Here an all-greedy step ends with one kernel (`accept_and_propose`) that
accepts the drafts against the argmax, appends the emitted tokens to each sequence's device
token history and drafts the next K tokens by prompt lookup (longest suffix match, the latest);
the next step's inputs (bonus token + drafts, positions, slots, context lengths) are then fixed
up on the device from the accepted counts (`feed_inputs`). The host learns the tokens one step
later, from a pinned copy enqueued with the step (core/spec_lookahead.py resolves them).

Rows of the history are the rows of the step's batch; a chain keeps its batch (any change
ends it, and the next chain's first step uploads the histories again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedinfer.kernels.ngram_ops import accept_and_propose


@dataclass
class ChainStep:
    """One launched step's device-side outcome: what each sequence emitted and its next drafts."""

    num_slots: torch.Tensor  # [B] int64 draft rows per sequence in the step (what the host planned)
    num_drafts: torch.Tensor  # [B] int64 drafts verified per sequence (0 for filler: no match)
    num_emitted: torch.Tensor  # [B] int64 accepted drafts + 1
    emitted: torch.Tensor  # [B, K_step + 1] int64 (0-padded past num_emitted)
    next_drafts: torch.Tensor  # [B, K] int64
    has_match: torch.Tensor  # [B] bool: next_drafts come from a match (else filler)
    host: torch.Tensor  # [B, 3 + K_step + 1 + K] int64 on the host (pinned on CUDA)
    ready: torch.cuda.Event | None  # after the host copy (None: on the CPU, ready now)

    def to_host(self) -> HostChainStep:
        if self.ready is not None:
            self.ready.synchronize()
        rows = self.host.tolist()
        width = self.emitted.shape[1]
        return HostChainStep(
            num_drafts=[r[0] for r in rows],
            emitted=[r[3 : 3 + r[1]] for r in rows],
            has_match=[bool(r[2]) for r in rows],
            next_drafts=[r[3 + width :] for r in rows],
        )


@dataclass
class HostChainStep:
    num_drafts: list[int]
    emitted: list[list[int]]  # per sequence: accepted drafts + the bonus token
    has_match: list[bool]
    next_drafts: list[list[int]]  # the next step's drafts (its inputs after the bonus token)


class DeviceNgramChain:
    """Token histories on the device and the per-step accept + propose launch."""

    def __init__(
        self,
        max_seqs: int,
        max_model_len: int,
        num_speculative_tokens: int,
        ngram_min: int,
        ngram_max: int,
        device: torch.device,
        backend: str | None = None,
    ) -> None:
        self.max_seqs = max_seqs
        self.k = num_speculative_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.device = device
        self.backend = backend
        # One extra column: a step appends up to K + 1 tokens to a history of < max_model_len.
        width = max_model_len + num_speculative_tokens + 1
        self.history = torch.zeros((max_seqs, width), dtype=torch.int32, device=device)
        self.history_len = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self._pin = device.type == "cuda"
        self._staging = torch.zeros((max_seqs, width), dtype=torch.int32, pin_memory=self._pin)
        self._staging_len = torch.zeros(max_seqs, dtype=torch.int32, pin_memory=self._pin)

    def start(self, token_lists: Sequence[Sequence[int]]) -> None:
        """Upload the histories of a chain's first step (row b: sequence b's known tokens)."""
        n = len(token_lists)
        staging, lens = self._staging.numpy(), self._staging_len.numpy()
        for b, tokens in enumerate(token_lists):
            staging[b, : len(tokens)] = tokens
            lens[b] = len(tokens)
        longest = int(lens[:n].max()) if n else 0
        self.history[:n, :longest].copy_(self._staging[:n, :longest], non_blocking=True)
        self.history_len[:n].copy_(self._staging_len[:n], non_blocking=True)

    def accept(
        self,
        argmax: torch.Tensor,  # [R] greedy token per logits row
        first_rows: Sequence[int],  # [B] host: first row of each sequence's group
        drafts: Sequence[Sequence[int]] | None,  # host drafts per group (a chain's first step)
        fed: ChainStep | None,  # the step before, whose drafts this step verified (chained)
    ) -> ChainStep:
        """Enqueue acceptance + the next drafts for a step's B groups, and their host copy."""
        num_seqs = len(first_rows)
        device = argmax.device
        rows = torch.tensor(first_rows, dtype=torch.int64, pin_memory=self._pin).to(device, non_blocking=True)
        if fed is not None:
            draft_ids = fed.next_drafts
            num_slots = torch.full((num_seqs,), draft_ids.shape[1], dtype=torch.int64, device=device)
            # Filler drafts (no match) are not verified: the row emits its bonus token only.
            num_drafts = torch.where(fed.has_match, num_slots, 0)
        else:
            width = max((len(d) for d in drafts), default=0)
            padded = np.zeros((num_seqs, max(width, 1)), dtype=np.int64)
            for b, d in enumerate(drafts):
                padded[b, : len(d)] = d
            counts = [len(d) for d in drafts]
            draft_ids = _to_device(torch.from_numpy(padded), device, self._pin)
            num_drafts = _to_device(torch.tensor(counts, dtype=torch.int64), device, self._pin)
            num_slots = num_drafts
        num_emitted, emitted, next_drafts, has_match = accept_and_propose(
            argmax,
            rows,
            draft_ids,
            num_drafts,
            self.history[:num_seqs],
            self.history_len[:num_seqs],
            self.ngram_min,
            self.ngram_max,
            self.k,
            backend=self.backend,
        )
        packed = torch.cat(
            [num_drafts[:, None], num_emitted[:, None], has_match[:, None].long(), emitted, next_drafts],
            dim=1,
        )
        ready = None
        if self._pin:
            host = packed.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = packed
        return ChainStep(num_slots, num_drafts, num_emitted, emitted, next_drafts, has_match, host, ready)


def feed_inputs(
    prev: ChainStep,
    input_ids: torch.Tensor,  # [>= B * q] the step's device buffers, staged for "all accepted"
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,  # [>= B]
    block_tables: torch.Tensor,  # [>= B, M]
    block_size: int,
) -> None:
    """Inputs of a chained step of B sequences x q = K + 1 tokens from the step before it.

    The host staged each sequence's positions, slots and context length as if every draft of
    the step before was accepted (an upper bound, so any length the host reads from them bounds
    the real one); here they move back by that step's rejected drafts, and the token ids become
    its bonus token followed by its next drafts.
    """
    num_seqs, k = prev.next_drafts.shape
    q = k + 1
    num_tokens = num_seqs * q
    rejected = prev.num_slots - (prev.num_emitted - 1)  # [B] draft rows whose KV is not kept
    bonus = prev.emitted.gather(1, (prev.num_emitted - 1)[:, None])  # [B, 1]
    input_ids[:num_tokens].view(num_seqs, q).copy_(torch.cat([bonus, prev.next_drafts], dim=1))
    pos = positions[:num_tokens].view(num_seqs, q)
    pos.sub_(rejected[:, None])
    seq_lens[:num_seqs].sub_(rejected.to(seq_lens.dtype))
    blocks = block_tables[:num_seqs].gather(1, (pos // block_size).to(torch.int64))  # [B, q]
    slot_mapping[:num_tokens].view(num_seqs, q).copy_(blocks.to(torch.int64) * block_size + pos % block_size)


def _to_device(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if pin:
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
