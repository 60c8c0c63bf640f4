"""N-gram speculation chained on the device: each step's acceptance and the next step's drafts are
decided where the logits are, so step N+1 is launched before step N's tokens reach the host.

Why: with the host deciding, a speculative step waits for its verification, then the host
accepts, proposes and stages the next one while the device idles; for a small model whose
step is host- and launch-bound that idle time is most of a plain step (bench/NOTES.md,
speculative n-gram). Here a step ends with one kernel (`accept_and_propose`) that accepts the
drafts against each row's token (the argmax; a sampled row's draw; with a draft model's drafts,
the rejection sampler's tokens laid over the rows: chained_sampling.ChainedSampling._chain_rejection), appends the emitted tokens to each sequence's device
token history and drafts the next K tokens by prompt lookup with the host proposer's rule
(spec_decode/ngram.py: longest suffix match, equally long ones ranked by context, then latest);
the next step's inputs (bonus token + drafts, positions, slots, context lengths) are then fixed
up on the device from the accepted counts (`DeviceNgramChain.feed`, one more kernel). The host learns the
tokens one step later, from one pinned copy of the packed result enqueued with the step
(core/spec_lookahead.py resolves them).

Rows of the history are the rows of the step's batch; a chain keeps its batch (any change
ends it, and the next chain's first step uploads the histories again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedinfer.engine.spec_decode.ngram import CONTEXT_WINDOW, MAX_RANKED_TIES
from pagedinfer.kernels import ngram_ops, ngram_reference
from pagedinfer.kernels.ngram_layout import (
    COL_HAS_MATCH,
    COL_NUM_DRAFTS,
    COL_NUM_EMITTED,
    PACKED_FIXED,
)


@dataclass
class ChainStep:
    """One launched step's device-side outcome, packed [B, PACKED_FIXED + K_step + 1 + K] int64:
    draft rows planned, drafts verified, tokens emitted, has-match, emitted tokens, next drafts."""

    packed: torch.Tensor
    k_step: int  # draft rows per sequence this step could hold (its emitted width is k_step + 1)
    host: torch.Tensor  # the same on the host (pinned on CUDA)
    ready: torch.cuda.Event | None  # after the host copy (None: on the CPU, ready now)

    @property
    def next_drafts(self) -> torch.Tensor:
        """[B, K] the drafts the next chained step verifies (a view of `packed`)."""
        return self.packed[:, PACKED_FIXED + self.k_step + 1 :]

    def to_host(self) -> HostChainStep:
        if self.ready is not None:
            self.ready.synchronize()
        rows = self.host.tolist()
        first_next = PACKED_FIXED + self.k_step + 1
        return HostChainStep(
            num_drafts=[r[COL_NUM_DRAFTS] for r in rows],
            emitted=[r[PACKED_FIXED : PACKED_FIXED + r[COL_NUM_EMITTED]] for r in rows],
            next_drafts=[r[first_next:] for r in rows],
        )


@dataclass
class HostChainStep:
    num_drafts: list[int]
    emitted: list[list[int]]  # per sequence: accepted drafts + the bonus token
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
        search: bool = True,
        match_keys: np.ndarray | None = None,
    ) -> None:
        """match_keys [V] (engine.spec_decode.ngram_keys): each id's key, matched where the ids match
        nowhere."""
        self.max_seqs = max_seqs
        # False (a draft model's chain): the accept kernel skips the prompt lookup, whose drafts
        # `with_drafts` would replace anyway.
        self.search = search
        self.k = num_speculative_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.device = device
        self.triton = ngram_ops.select_backend(device, backend) == "triton"
        self.match_keys = (
            None if match_keys is None else torch.as_tensor(match_keys, dtype=torch.int32).to(device)
        )
        # One extra column: a step appends up to K + 1 tokens to a history of < max_model_len.
        width = max_model_len + num_speculative_tokens + 1
        self.history = torch.zeros((max_seqs, width), dtype=torch.int32, device=device)
        self.history_len = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self._pin = device.type == "cuda"
        self._staging = torch.zeros((max_seqs, width), dtype=torch.int32, pin_memory=self._pin)
        self._staging_len = torch.zeros(max_seqs, dtype=torch.int32, pin_memory=self._pin)
        # A first step's groups, flat: first rows [B], draft counts [B], drafts [B, K] (0-padded)
        self._groups = torch.zeros(max_seqs * (2 + self.k), dtype=torch.int64, pin_memory=self._pin)
        # Staging of a chained step's admitted rows (`add_rows`, `accept`): buffers of their own,
        # since the first step's above may still be read by copies queued behind that step.
        self._add_hist = _Staging(self._pin, torch.int32)
        self._add_len = _Staging(self._pin, torch.int32)
        self._add_rows = _Staging(self._pin, torch.int64)

    def start(self, token_lists: Sequence[Sequence[int]]) -> None:
        """Upload the histories of a chain's first step (row b: sequence b's known tokens)."""
        self._upload(0, token_lists, self._staging, self._staging_len)

    def add_rows(self, first: int, token_lists: Sequence[Sequence[int]]) -> None:
        """Upload the histories of sequences that join a chained step (prompts it admitted) as
        rows first, first + 1, ... (rows before them stay as they are)."""
        n = len(token_lists)
        if n == 0:
            return
        if first + n > self.max_seqs:
            raise ValueError(f"{first + n} chained sequences exceed the chain's {self.max_seqs}")
        hist = self._add_hist.take(n, self.history.shape[1])
        self._upload(first, token_lists, hist, self._add_len.take(n))
        self._add_hist.copied()
        self._add_len.copied()

    def _upload(
        self, first: int, token_lists: Sequence[Sequence[int]], hist: torch.Tensor, lens: torch.Tensor
    ) -> None:
        """Rows first, first + 1, ... of the histories from `token_lists`, through the host
        buffers `hist` [>= n, W] and `lens` [>= n] (pinned on CUDA: the copies do not wait)."""
        n = len(token_lists)
        staging, lens_np = hist.numpy(), lens.numpy()
        for b, tokens in enumerate(token_lists):
            staging[b, : len(tokens)] = tokens
            lens_np[b] = len(tokens)
        longest = int(lens_np[:n].max()) if n else 0
        self.history[first : first + n, :longest].copy_(hist[:n, :longest], non_blocking=True)
        self.history_len[first : first + n].copy_(lens[:n], non_blocking=True)

    def accept(
        self,
        argmax: torch.Tensor,  # [R] the token per logits row the drafts are matched against
        first_rows: Sequence[int],  # [B] host: first row of each sequence's group
        drafts: Sequence[Sequence[int]] | None,  # host drafts per group (a chain's first step)
        fed: ChainStep | None,  # the step before, whose drafts this step verifies (chained)
        copy: bool = True,
        device_drafts: torch.Tensor | None = None,  # [B, K] a first step's drafts, on the device
    ) -> ChainStep:
        """Enqueue acceptance + the next drafts for a step's B groups, and their host copy
        (`copy` False: none yet; `copy_to_host` copies several steps' results at once).

        A first step's drafts come from the host (`drafts`), or, made by a draft model on the
        device, from `device_drafts` (`drafts` then gives their counts only)."""
        num_seqs, k = len(first_rows), self.k
        history, history_len = self.history[:num_seqs], self.history_len[:num_seqs]
        ngram = (self.ngram_min, self.ngram_max, k)
        # ranked as the host proposer ranks
        rank = {
            "context_window": CONTEXT_WINDOW,
            "max_ties": MAX_RANKED_TIES,
            "search": self.search,
            "match_keys": self.match_keys,
        }
        if fed is not None:  # its next drafts, verified where they came from a match
            next_col = PACKED_FIXED + fed.k_step + 1
            drafts_dev, has_match = fed.packed[:, next_col:], fed.packed[:, COL_HAS_MATCH]
            num_admitted = num_seqs - fed.packed.shape[0]
            rows = None  # dense: group b's rows start at b (K + 1)
            if num_admitted > 0:  # prompts admitted behind the chained rows: one row, no drafts
                drafts_dev = torch.cat(
                    [drafts_dev, drafts_dev.new_zeros((num_admitted, drafts_dev.shape[1]))]
                )
                has_match = torch.cat([has_match, has_match.new_zeros(num_admitted)])
                rows = self._stage_rows(first_rows, argmax.device)
            if self.triton:
                packed = ngram_ops.launch_packed(
                    argmax, rows, drafts_dev, has_match, k, history, history_len, *ngram, **rank
                )
            else:
                slots = has_match * k  # (the kernel's: the verified count, or K for dense rows)
                if rows is None:
                    rows = torch.arange(num_seqs, device=argmax.device) * (k + 1)
                    slots = torch.full((num_seqs,), k, dtype=torch.int64, device=argmax.device)
                packed = _reference_packed(
                    argmax, rows, drafts_dev, has_match * k, slots, history, history_len, ngram, **rank
                )
        else:
            size = num_seqs * (2 + k)
            flat = self._groups.numpy()[:size]
            flat[:] = 0
            flat[:num_seqs] = first_rows
            padded = flat[2 * num_seqs :].reshape(num_seqs, k)
            for b, d in enumerate(drafts):
                flat[num_seqs + b] = len(d)
                if device_drafts is None:
                    padded[b, : len(d)] = d
            staged = self._groups[:size].to(argmax.device, non_blocking=True)
            if not self._pin:  # on the CPU .to() is the staging buffer itself, reused next step
                staged = staged.clone()
            rows, counts = staged[:num_seqs], staged[num_seqs : 2 * num_seqs]
            drafts_dev = staged[2 * num_seqs :].view(num_seqs, k) if device_drafts is None else device_drafts
            if self.triton:
                packed = ngram_ops.launch_packed(
                    argmax, rows, drafts_dev, counts, 1, history, history_len, *ngram, **rank
                )
            else:
                packed = _reference_packed(
                    argmax, rows, drafts_dev, counts, counts, history, history_len, ngram, **rank
                )
        step = ChainStep(packed, k, packed, None)
        if copy:
            self.copy_to_host([step])
        return step

    def _stage_rows(self, first_rows: Sequence[int], device: torch.device) -> torch.Tensor:
        """[B] int64 first rows on the device (a chained step with admissions: not dense)."""
        n = len(first_rows)
        host = self._add_rows.take(n)
        host.numpy()[:n] = first_rows
        staged = host[:n].to(device, non_blocking=True)
        self._add_rows.copied()
        return staged if self._pin else staged.clone()

    def copy_to_host(self, steps: Sequence[ChainStep]) -> None:
        """One host copy of the steps' packed results (pinned, enqueued now; on the CPU they are
        on the host already)."""
        if not self._pin:
            return
        packed = steps[0].packed if len(steps) == 1 else torch.stack([s.packed for s in steps])
        host = packed.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        for i, step in enumerate(steps):
            step.host = host if len(steps) == 1 else host[i]
            step.ready = ready

    def with_drafts(self, step: ChainStep, drafts: torch.Tensor) -> ChainStep:
        """`step` with its next drafts replaced by [B, K] drafts made elsewhere on the device (a
        draft model's), all of them to be verified: what the next chained step feeds on."""
        packed = step.packed.clone()
        packed[:, PACKED_FIXED + step.k_step + 1 :] = drafts
        packed[:, COL_HAS_MATCH] = 1
        return ChainStep(packed, step.k_step, packed, None)

    def select_rows(self, step: ChainStep, rows: Sequence[int]) -> ChainStep:
        """Keep the histories of `rows` of `step`'s batch, in that order, as the rows of the next
        step's (sequences that stopped in between are dropped); `step`'s result for them."""
        index = torch.tensor(rows, dtype=torch.int64, pin_memory=self._pin).to(self.device, non_blocking=True)
        n = len(rows)
        self.history[:n] = self.history.index_select(0, index)
        self.history_len[:n] = self.history_len.index_select(0, index)
        packed = step.packed.index_select(0, index)
        return ChainStep(packed, step.k_step, packed, None)

    def feed(
        self,
        prev: ChainStep,
        input_ids: torch.Tensor,  # [>= B * q] the step's device buffers
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,  # [>= B]
        block_tables: torch.Tensor,  # [>= B, M] covering every position the step can take
        block_size: int,
    ) -> None:
        """Inputs of a chained step of B sequences x q = K + 1 tokens from the step before it.

        Each sequence's inputs are the step before's bonus token, at the last position of its
        token history, and that step's next drafts after it; positions, slots and the context
        length follow from the history's length. Nothing the host staged for them is read, so
        the step before may itself be chained (several chained steps per launch).
        """
        args = (self.history_len, input_ids, positions, slot_mapping, seq_lens, block_tables, block_size)
        if self.triton:
            ngram_ops.launch_chain_feed(prev.packed, prev.k_step, *args)
        else:
            feed_inputs_torch(prev, *args)


class _Staging:
    """Pinned host buffers used in two turns: a turn is refilled only after the copies enqueued
    from it (`copied`) have run, so a copy still queued never reads the next step's values."""

    def __init__(self, pin: bool, dtype: torch.dtype) -> None:
        self.pin, self.dtype = pin, dtype
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def take(self, rows: int, *width: int) -> torch.Tensor:
        """This turn's buffer, [>= rows, *width]."""
        t = self.turn
        if self.events[t] is not None:
            self.events[t].synchronize()  # (two steps back: done long since in practice)
        buf = self.buffers[t]
        if buf is None or buf.shape[0] < rows:
            buf = self.buffers[t] = torch.zeros((max(rows, 8), *width), dtype=self.dtype, pin_memory=self.pin)
        return buf

    def copied(self) -> None:
        """The copies from this turn's buffer are enqueued: the next take() uses the other."""
        if self.pin:
            self.events[self.turn] = torch.cuda.Event()
            self.events[self.turn].record()
        self.turn ^= 1


def _reference_packed(
    argmax, rows, drafts, num_drafts, num_slots, history, history_len, ngram, **rank
) -> torch.Tensor:
    """The torch path's result in the Triton kernel's packed layout (rank: launch_packed's)."""
    out = ngram_reference.accept_and_propose(
        argmax, rows, drafts, num_drafts, history, history_len, *ngram, **rank
    )
    return torch.cat(
        [
            num_slots[:, None],
            num_drafts[:, None],
            out.num_emitted[:, None],
            out.has_match[:, None].long(),
            out.emitted,
            out.next_drafts,
        ],
        dim=1,
    )


def feed_inputs_torch(
    prev: ChainStep, history_len, input_ids, positions, slot_mapping, seq_lens, block_tables, block_size
) -> None:
    """`DeviceNgramChain.feed` in torch ops (the CPU path; the oracle of the Triton kernel)."""
    packed = prev.packed
    num_seqs = packed.shape[0]
    next_col = PACKED_FIXED + prev.k_step + 1
    next_drafts = packed[:, next_col:]
    q = next_drafts.shape[1] + 1
    num_tokens = num_seqs * q
    num_emitted = packed[:, COL_NUM_EMITTED]
    bonus = packed[:, PACKED_FIXED:next_col].gather(1, (num_emitted - 1)[:, None])  # [B, 1]
    input_ids[:num_tokens].view(num_seqs, q).copy_(torch.cat([bonus, next_drafts], dim=1))
    start = history_len[:num_seqs].to(torch.int64) - 1  # [B] the bonus token's position
    pos = start[:, None] + torch.arange(q, dtype=torch.int64, device=start.device)  # [B, q]
    positions[:num_tokens].view(num_seqs, q).copy_(pos)
    seq_lens[:num_seqs].copy_(start + q)
    slot_mapping[:num_tokens].view(num_seqs, q).copy_(slots_at(block_tables[:num_seqs], pos, block_size))


def slots_at(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, q] int64 KV slots of positions [B, q] through block tables [B, M], on the device."""
    blocks = block_tables.gather(1, positions // block_size).to(torch.int64)
    return blocks * block_size + positions % block_size
