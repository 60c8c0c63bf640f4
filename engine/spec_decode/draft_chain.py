"""Chained draft steps (core/spec_lookahead.py): a draft model's step N+1 drafted on the device from
the token histories before the host knows what step N accepted, then resolved or ended once it
does. A mixin of `DraftModelProposer` (draft_model.py), whose cache and forward it drives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from pagedinfer.engine.core.lookahead import PLACEHOLDER_TOKEN_ID
from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.sample.metadata import SamplingMetadata
from pagedinfer.engine.spec_decode.device_chain import slots_at
from pagedinfer.engine.spec_decode.draft_records import (
    DraftSeq,
    common_prefix,
    fit_vocab,
    token_span,
)
from pagedinfer.engine.worker.input_batch import InputBatch
from pagedinfer.kernels.argmax import argmax_rows


class DraftChains:
    """DraftModelProposer's chained steps: reserve, launch, resolve, end."""

    # ---- chained steps (drafted on the device from the step before's acceptance) ---------------
    # A chained step N+1 of sequence s starts at `end` (where N's inputs end: the position of N's
    # bonus token if all of N's drafts survive). Before it, the draft cache holds s up to end - 1:
    # N's inputs but the last draft. N+1's draft steps, from the device history of length L
    # (L - 1 = the bonus token's actual position, <= end): one step of 2 tokens at L - 2, L - 1
    # (the last accepted token or N's bonus token, recomputed: positions before it are valid; then
    # N's new bonus token), then K - 1 steps of one draft each at L .. L + K - 2. Positions up to
    # end + K - 1 are reserved (every draft of N accepted).
    def reserve_chained(
        self,
        seq_ids: Sequence[int],
        starts: Sequence[int],
        ends: Sequence[int],
        known: Sequence[Sequence[int] | None] | None = None,
    ):
        """Draft-cache room for a chained step of these sequences, after a step N whose inputs
        were [starts, ends); an undo function, or None (no room, or a sequence whose cache is
        not where a chained step starts: no chain).

        `known[i]`: sequence i's tokens [0, end) where N verified no drafts of it (a prompt
        admitted at N): its cache is caught up to them first (`_prefill_for_chain`), so an
        admission does not end the chain for a synchronous proposal."""
        k = self.num_speculative_tokens
        ready = self._prefill_for_chain(seq_ids, known) if known else set()
        done: list[tuple[int, int, int | None]] = []  # (seq_id, end, previous first placeholder)

        chained_before = set(self._chained)

        def undo() -> None:
            for seq_id, end, first in done:
                self._release(seq_id, end - 1)
                if first is None:
                    self._placeholders.pop(seq_id, None)
            self._chained.intersection_update(chained_before)

        fed = self._unresolved.rows if self._unresolved is not None else {}
        for seq_id, start, end in zip(seq_ids, starts, ends, strict=True):
            state = self._seqs.get(seq_id)
            # N's drafts were made from this cache on the device (their ids placeholders, their
            # blocks unhashed), in a chained step or a device proposal: it knew N's first input
            # and holds its inputs but the last draft. Drafts the host read were recorded (and
            # hashed) with their ids: rejected ones would stay in the records.
            drafted_on_device = seq_id in self._chained or seq_id in fed
            if (
                state is None
                or (seq_id not in ready and (not drafted_on_device or state.num_known != start + 1))
                or len(state.cached_ids) != end - 1
                or self._computed[seq_id] != end - 1
            ):
                undo()
                return None
            copies = self.kv.append(seq_id, [PLACEHOLDER_TOKEN_ID] * (k + 1))
            if copies is None:
                undo()
                return None
            self._copy_blocks(copies)
            done.append((seq_id, end, self._placeholders.get(seq_id)))
            state.cached_ids.extend([PLACEHOLDER_TOKEN_ID] * (k + 1))
            self._placeholders.setdefault(seq_id, end - 1)
            self._computed[seq_id] = end + k
        # The ids of drafts fed on the device before now reach the records with the accepted
        # tokens (`resolve_chained`), not from the proposal's copy (`resolve` skips them).
        self._chained.update(seq_ids)
        return undo

    def _prefill_for_chain(self, seq_ids: Sequence[int], known: Sequence[Sequence[int] | None]) -> set[int]:
        """Bring the caches of the sequences with known tokens [0, end) to all of them but the
        last, computed (where a chained step's first draft step starts: it recomputes end - 1
        with the bonus token). One forward for all (a graph replay when none needs > 2 tokens);
        the sequences now ready. A cache with device drafts in its records (placeholders) is left
        alone: its sequence gets no chain."""
        fed = self._unresolved.rows if self._unresolved is not None else {}
        ready: set[int] = set()
        run_ids: list[int] = []
        run_new: list[int] = []
        for seq_id, tokens in zip(seq_ids, known, strict=True):
            if tokens is None or len(tokens) < 2:
                continue
            if seq_id in self._chained or seq_id in fed or seq_id in self._placeholders:
                continue
            target = list(tokens[:-1])
            state = self._seqs.get(seq_id)
            if state is None:
                num_cached = self.kv.allocate(seq_id, target)  # (prefix-cache hits are computed)
                if num_cached is None:
                    continue
                state = self._seqs[seq_id] = DraftSeq(target, len(tokens))
                self._computed[seq_id] = num_cached
            else:
                keep = common_prefix(state.cached_ids, target, start=min(state.num_known, len(target)))
                if keep < len(state.cached_ids):
                    self._copy_blocks(self.kv.truncate(seq_id, keep))
                    del state.cached_ids[keep:]
                self._computed[seq_id] = min(self._computed[seq_id], keep)
                if not self._append(seq_id, target[keep:]):
                    continue  # the draft cache is full (the sequence was freed from it)
                state.num_known = len(tokens)
            if self._computed[seq_id] < len(target):
                run_ids.append(seq_id)
                run_new.append(len(target) - self._computed[seq_id])
            ready.add(seq_id)
        if run_ids:
            self._forward(run_ids, run_new)
        return ready

    def _release(self, seq_id: int, keep: int) -> None:
        """Drop a sequence's draft records and reservation from position `keep` on."""
        state = self._seqs[seq_id]
        if len(state.cached_ids) > keep:
            self._copy_blocks(self.kv.truncate(seq_id, keep))
            del state.cached_ids[keep:]
        self._computed[seq_id] = min(self._computed[seq_id], keep)

    @torch.inference_mode()
    def launch_chained(
        self,
        seq_ids: Sequence[int],
        ends: Sequence[int],
        history: torch.Tensor,  # [>= B, W] the device token histories (device_chain.py)
        history_len: torch.Tensor,  # [>= B] int32
        sampling_rows: Sequence[SamplingRow] | None = None,  # [B] the sequences' (None: greedy)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Enqueue a chained step's K draft steps (`reserve_chained` first); its drafts [B, K]
        int64 on the device, and their q [B, K, V] when some row samples (None: all greedy).
        Staged for the case that every draft of the step before survives, moved back on the
        device by what it accepted (as the target's chained inputs). Sampled rows are drawn as
        `_sample` draws them, at output positions read from the device histories."""
        num_seqs, k = len(seq_ids), self.num_speculative_tokens
        sampling = None
        if sampling_rows is not None and not all(r.sampling_params.is_greedy for r in sampling_rows):
            sampling = self._chain_sampling(sampling_rows, history_len)
        probs = None  # (every draft step writes every row)
        if sampling is not None:
            probs = torch.empty((num_seqs, k, self.vocab_size), dtype=torch.float32, device=self.device)
        batch = self._chain_inputs(int(history.shape[0]), int(history.shape[1]))
        timed = self.device.type == "cuda" and self.record_device_times
        start = torch.cuda.Event(enable_timing=True) if timed else None
        if start is not None:
            start.record()
        drafts = torch.empty((num_seqs, k), dtype=torch.int64, device=self.device)
        lens = history_len[:num_seqs].to(torch.int64)
        rows = torch.arange(num_seqs, device=self.device)
        shift: torch.Tensor | None = None  # [B] staged (all accepted) - actual positions
        prev: torch.Tensor | None = None
        for step in range(k):
            q = 2 if step == 0 else 1
            if step < 2:
                first = [e - 1 if step == 0 else e + step for e in ends]
                layout = self.kv.build_batch(seq_ids, first, [q] * num_seqs)
                if step == 1 and k > 2:  # steps 2.. advance these rows on the device: the tables
                    last = self.kv.build_batch(seq_ids, [e + k - 1 for e in ends], [1] * num_seqs)
                    layout = dataclasses.replace(layout, block_tables=last.block_tables)  # reach them
                key = self.graphs.select(num_seqs, q) if self.graphs is not None else None
                last_rows = np.arange(q - 1, num_seqs * q, q, dtype=np.int64)
                inputs = batch.stage(np.zeros(num_seqs * q, np.int64), layout, last_rows, key)
                seq_lens = batch.seq_lens[:num_seqs]
                if shift is None:
                    shift = seq_lens.to(torch.int64) - lens  # staged context L_max vs actual L
                pos = batch.pos[: num_seqs * q].view(num_seqs, q)
                pos.sub_(shift[:, None])
                seq_lens.sub_(shift.to(seq_lens.dtype))
            else:  # one position on from the step before, in place: no host layout, no copies
                pos.add_(1)
                seq_lens.add_(1)
                if key is None:  # eager: the longest context bounds its grid (graphs: capacity)
                    inputs.attn_metadata.max_seq_len += 1
            slots = slots_at(batch.block_tables[:num_seqs], pos, self.kv.block_size)
            batch.slots[: num_seqs * q].view(num_seqs, q).copy_(slots)
            ids = batch.ids[: num_seqs * q].view(num_seqs, q)
            if step == 0:  # the token at L - 2 (recomputed) and the new bonus token at L - 1
                ids.copy_(history[rows[:, None], pos].to(torch.int64))
            else:
                ids.copy_(prev[:, None])
            if key is not None:
                hidden = self.graphs.replay(key)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
            md = inputs.attn_metadata
            # greedy rows read the argmax only, the same in the GEMM's dtype (sampled rows: process upcasts)
            logits = self.model.compute_logits(hidden[md.logits_indices], upcast=False, backend=self.backend)
            if sampling is None:
                prev = argmax_rows(fit_vocab(logits, self.vocab_size), self.backend)  # [B]
            else:
                meta, first_positions = sampling
                if meta.seeded_rows is not None:
                    meta.positions = first_positions + step
                prev, probs[:, step] = self._draw_with_q(fit_vocab(logits, self.vocab_size), meta)
            drafts[:, step] = prev
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._chain_times.append((start, end))
        return drafts, probs

    def _chain_sampling(
        self, rows: Sequence[SamplingRow], history_len: torch.Tensor
    ) -> tuple[SamplingMetadata, torch.Tensor | None]:
        """Chained draft steps' sampling metadata [B] (built once a launch; `_draw_with_q` salts
        the seeds), and each seeded row's output position at the first draft step: its history
        length on the device (the step before's tokens appended) - its prompt."""
        meta = self._chain_metadata.build(rows)
        if meta.seeded_rows is None:
            return meta, None
        seeded = [i for i, r in enumerate(rows) if r.seed is not None and not r.sampling_params.is_greedy]
        prompts = [len(rows[i].prompt_token_ids) for i in seeded]
        pin = self.device.type == "cuda"
        staged = torch.tensor([seeded, prompts], dtype=torch.int64, pin_memory=pin).to(
            self.device, non_blocking=True
        )
        return meta, history_len.index_select(0, staged[0]).to(torch.int64) - staged[1]

    def _chain_inputs(self, max_seqs: int, max_len: int) -> InputBatch:
        """The chained draft steps' input buffers: the graphs' static ones, else a batch of their own."""
        if self.graphs is not None:
            return self.graphs.batch
        if self._chain_batch is None:
            block_size = self.kv.block_size
            self._chain_batch = InputBatch(
                max_num_tokens=2 * max_seqs,
                max_num_seqs=max_seqs,
                max_blocks_per_seq=-(-(max_len + self.num_speculative_tokens) // block_size),
                scratch_block=self.kv.num_blocks,
                block_size=block_size,
                device=self.device,
                backend=self.backend,
                num_staging_sets=self._num_staging_sets(),
            )
        return self._chain_batch

    def _num_staging_sets(self) -> int:
        """Two launches' draft steps staged without waiting: a chained launch stages its K draft
        steps while the launch before it may still be queued on the device."""
        return 2 * self.num_speculative_tokens

    def resolve_chained(self, known: dict[int, tuple[Sequence[int], Sequence[int]]]) -> None:
        """The step before a launched chained step was applied: each sequence's known tokens
        (prompt ids, output ids; L in all). Positions below L get their ids (the chained step's
        first draft step recomputes L - 2 and L - 1 with them); the reservation shrinks to the
        chained step's L + K - 1 positions, its drafts (placeholders) from L on."""
        k = self.num_speculative_tokens
        for seq_id, (prompt, output) in known.items():
            state = self._seqs.get(seq_id)
            if state is None or seq_id not in self._chained:
                continue
            num_known = len(prompt) + len(output)
            self._release(seq_id, num_known + k - 1)
            first = min(self._placeholders.get(seq_id, num_known), num_known)
            self._set_ids(seq_id, first, token_span(prompt, output, first, num_known))
            self._placeholders[seq_id] = num_known
            self._computed[seq_id] = num_known + k - 1
            state.num_known = num_known
        self._harvest_chain_times()

    @property
    def has_chains(self) -> bool:
        """Whether some sequence's records still follow a chain (`end_chains` settles them)."""
        return bool(self._chained)

    def end_chains(self, known: dict[int, tuple[Sequence[int], Sequence[int]]]) -> None:
        """Right after a chain's last step was applied (before any other step of its sequences):
        each sequence's records after it, from its tokens now (prompt ids, output ids). Valid are
        its ids before the last step's last accepted position + 1 (that one held a rejected
        draft, or none); the rest is dropped, and the next catch-up feeds the sequence from there.
        A sequence not in `known` keeps what was known before the last step (positions below its
        first placeholder)."""
        if not self._chained:
            return
        for seq_id in self._chained:
            state = self._seqs.get(seq_id)
            if state is None:
                continue
            first = self._placeholders.pop(seq_id, min(state.num_known, len(state.cached_ids)))
            tokens = known.get(seq_id)
            if tokens is None:
                self._release(seq_id, first)
                state.num_known = min(state.num_known, first)
                continue
            prompt, output = tokens
            valid = min(len(state.cached_ids), len(prompt) + len(output) - 1)
            self._release(seq_id, valid)
            first = min(first, valid)
            self._set_ids(seq_id, first, token_span(prompt, output, first, valid))
            state.num_known = valid
        self._chained.clear()
        self._harvest_chain_times()

    def _set_ids(self, seq_id: int, first: int, real: list[int]) -> None:
        """Placeholders from `first` on get the sequence's ids `real`; full blocks before their
        end are hashed."""
        upto = first + len(real)
        if real:
            self._seqs[seq_id].cached_ids[first:upto] = real
            self.kv.set_tokens(seq_id, first, real)
        self.kv.mark_computed([seq_id], [upto])

    def _harvest_chain_times(self) -> None:
        """Device times of chained draft launches that have run (a bench asked for them)."""
        while self._chain_times and self._chain_times[0][1].query():
            start, end = self._chain_times.pop(0)
            self.device_times_ms.append(start.elapsed_time(end))
