"""Draft-model proposer: a smaller model with the target's vocabulary and its own paged KV cache.

Each engine step it runs K forwards for all drafting sequences at once: the first catches its
cache up with the sequence (the tokens accepted since last time, or the whole prompt on first
sight), each later one decodes the previous draft. Its cache is managed by its own
`KVCacheManager` (its own block manager); after verification it keeps the longest prefix that
still matches the sequence and truncates the rest (rejected drafts), exactly like the target.

q is the draft's distribution processed with the sequence's sampling parameters exactly as the
target's p is (penalties over outputs + earlier drafts, temperature, top-k/p, min-p, bans), and
draft tokens are drawn from it with noise keyed by a salted seed, independent of the noise that
the rejection sampler later uses at the same positions.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.lookahead import PLACEHOLDER_TOKEN_ID
from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.sample.metadata import (
    SamplingMetadata,
    SamplingMetadataBuilder,
    build_sampling_metadata,
)
from pagedinfer.engine.sample.sampler import Sampler
from pagedinfer.engine.spec_decode.device_chain import slots_at
from pagedinfer.engine.spec_decode.proposer import DeviceDrafts, DraftProposals, DraftRequest
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.engine.worker.cuda_graphs import CudaGraphRunner, default_buckets, graph_keys
from pagedinfer.engine.worker.input_batch import InputBatch
from pagedinfer.kernels import ops
from pagedinfer.kernels.argmax import argmax_rows

logger = logging.getLogger(__name__)

_DRAFT_SALT = 0x2545F4914F6CDD1D  # < 2**63: keeps salted seeds non-negative


class DraftModelError(ValueError):
    """A draft model that cannot serve this target (vocabulary mismatch, bad specification)."""


def check_same_vocabulary(target_tokenizer, draft_tokenizer) -> None:
    """Raise DraftModelError unless both tokenizers map the same strings to the same ids."""
    if target_tokenizer is None or draft_tokenizer is None:
        raise DraftModelError("the target and the draft model both need a tokenizer to check vocabularies")
    target_vocab = target_tokenizer.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft_tokenizer.backend.get_vocab(with_added_tokens=True)
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])[:3]
        raise DraftModelError(
            f"the draft model's vocabulary ({len(draft_vocab)} tokens) differs from the target's "
            f"({len(target_vocab)} tokens), e.g. {differing}; speculative decoding needs a draft "
            "model with the target's tokenizer"
        )


@dataclass
class _DraftSeq:
    """What the draft cache holds for one sequence."""

    cached_ids: list[int]  # tokens whose K/V are in the draft cache, in order
    num_known: int  # real (non-draft) tokens of the sequence at the last proposal


class DraftModelProposer:
    """Proposer running a draft model (any module with the `LlamaForCausalLM` call interface)."""

    draws_drafts = True

    def __init__(
        self,
        model,
        kv: KVCacheManager,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        num_speculative_tokens: int,
        target_vocab_size: int,
        attention_backend: str | None = None,
        device_drafts: bool = True,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.model = model
        self.kv = kv
        self.kv_caches = kv_caches
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = target_vocab_size
        self.backend = attention_backend
        self.sampler = Sampler()
        self.device = model.device
        # Chained launches' sampling metadata: the parameter tensors are reused while the chain's
        # rows keep their parameters (one launch after another)
        self._chain_metadata = SamplingMetadataBuilder(target_vocab_size, self.device)
        self._seqs: dict[int, _DraftSeq] = {}
        self._computed: dict[int, int] = {}  # tokens per sequence whose K/V are written
        self.graphs: CudaGraphRunner | None = None
        # Batches without penalties or min_tokens (greedy or sampled) draft on the device
        # (`_propose_on_device`); the drafts' ids reach the host (and this cache's records) after
        # the verification (`resolve`).
        self.device_drafts = device_drafts
        self._unresolved: DeviceDrafts | None = None
        self._placeholders: dict[int, int] = {}  # seq_id -> first cached position fed a draft
        # Device time of each device-drafted proposal, once resolved (CUDA; when asked: a bench)
        self.record_device_times = False
        self.device_times_ms: list[float] = []
        # Chained steps (core/spec_lookahead.py): drafted from the device token histories before
        # the host knows what the step before accepted. Sequences whose cache records trail that
        # way; the draft steps' input buffers; timed chained drafts not yet read.
        self._chained: set[int] = set()
        self._chain_batch: InputBatch | None = None
        self._chain_times: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the draft's steady-state steps (CUDA only): one token per sequence (a draft
        step) and up to two (catching up after verification: the last draft + the bonus token)."""
        if self.device.type != "cuda":
            return
        graphs = self.graph_runner(max_num_seqs, max_model_len)
        try:
            graphs.capture()
        except RuntimeError:  # e.g. a backend that syncs the host: the draft runs eagerly
            logger.exception("draft model CUDA graph capture failed; draft steps run eagerly")
            torch.cuda.synchronize()
            return
        self.graphs = graphs

    def graph_runner(self, max_num_seqs: int, max_model_len: int) -> CudaGraphRunner:
        """An uncaptured graph runner over static buffers of the draft's own.

        The draft's KV caches hold one block more than its `kv` manager hands out: the scratch
        block that padded rows write to.
        """
        scratch, block_size = self.kv.num_blocks, self.kv_caches[0][0].shape[1]
        if self.kv_caches[0][0].shape[0] <= scratch:
            raise ValueError("the draft KV caches need one scratch block beyond the managed ones")
        batch = InputBatch(
            max_num_tokens=2 * max_num_seqs,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=-(-(max_model_len + self.num_speculative_tokens) // block_size),
            scratch_block=scratch,
            block_size=block_size,
            device=self.device,
            backend=self.backend,
            num_staging_sets=self._num_staging_sets(),
        )
        keys = graph_keys(default_buckets(max_num_seqs), (1, 2), batch.max_num_tokens)
        return CudaGraphRunner(self.model, self.kv_caches, batch, keys)

    # ---- Proposer -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> DraftProposals:
        self.resolve()  # (a chain's records are settled before any proposal: `end_chains`)
        if self.device_drafts and requests and all(r.row.sampling_params.is_history_free for r in requests):
            return self._propose_on_device(requests)
        num_reqs = len(requests)
        k_max = min(self.num_speculative_tokens, max((r.max_draft_tokens for r in requests), default=0))
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        probs = None  # [R, K, V] q; stays None while every row is greedy (q is then irrelevant)
        active = [b for b, r in enumerate(requests) if self._catch_up(r)]
        for step in range(k_max):
            if step > 0:  # feed the previous draft
                active = [b for b in active if step < requests[b].max_draft_tokens]
                active = [b for b in active if self._append(requests[b].seq_id, [drafts[b][-1]])]
            if not active:
                break
            seq_ids = [requests[b].seq_id for b in active]
            num_new = [len(self._seqs[s].cached_ids) - self._computed[s] for s in seq_ids]
            logits = self._forward(seq_ids, num_new)  # [A, V]
            tokens, q = self._sample(logits, [requests[b] for b in active], [drafts[b] for b in active])
            for i, b in enumerate(active):
                drafts[b].append(tokens[i])
            if q is not None:
                if probs is None:
                    shape = (num_reqs, k_max, self.vocab_size)
                    probs = torch.zeros(shape, dtype=torch.float32, device=self.device)
                probs[torch.tensor(active, device=self.device), step] = q
        for request in requests:
            state = self._seqs.get(request.seq_id)
            if state is not None:
                state.num_known = request.num_tokens
        return DraftProposals(token_ids=drafts, probs=probs)

    def _propose_on_device(self, requests: Sequence[DraftRequest]) -> DraftProposals:
        """`propose` for history-free requests (no penalties or min_tokens bans: nothing reads the
        drafts before a row) without waiting for the device: each draft step's input is the draw
        of the step before, on the device (plain greedy: its argmax); the drafts [R, K] stay there
        (the runner writes them into the verification's inputs) and one host copy is enqueued.
        Sampled rows are drawn as `_sample` draws them (the same seeded noise: the same drafts),
        and their distributions q stay on the device for the verification's rejection sampler."""
        num_reqs = len(requests)
        k_max = min(self.num_speculative_tokens, max(r.max_draft_tokens for r in requests))
        greedy = all(r.row.sampling_params.is_greedy for r in requests)
        probs = None  # [R, K, V] q of sampled requests (None: all greedy, q plays no part)
        cuda = self.device.type == "cuda"
        timed = cuda and self.record_device_times
        start = torch.cuda.Event(enable_timing=True) if timed else None
        if start is not None:
            start.record()
        tokens = torch.zeros((num_reqs, k_max), dtype=torch.int64, device=self.device)
        counts = [0] * num_reqs
        active = [b for b, r in enumerate(requests) if self._catch_up(r)]
        prev: torch.Tensor | None = None  # [A] the last step's drafts, in `active` order
        for step in range(k_max):
            if step > 0:  # feed the previous draft: its id is known on the device only
                keep = [
                    i
                    for i, b in enumerate(active)
                    if step < requests[b].max_draft_tokens and self._append_fed(requests[b].seq_id)
                ]
                if len(keep) != len(active):
                    prev = prev[torch.tensor(keep, dtype=torch.int64).to(self.device, non_blocking=True)]
                    active = [active[i] for i in keep]
            if not active:
                break
            seq_ids = [requests[b].seq_id for b in active]
            num_new = [len(self._seqs[s].cached_ids) - self._computed[s] for s in seq_ids]
            logits = self._forward(seq_ids, num_new, fed=prev if step > 0 else None)  # [A, V]
            q = None
            if greedy:
                prev = argmax_rows(logits, self.backend)  # [A]
            else:
                prev, q = self._draw(logits, [requests[b] for b in active], step)
                if probs is None:
                    probs = torch.zeros(
                        (num_reqs, k_max, self.vocab_size), dtype=torch.float32, device=self.device
                    )
            if len(active) == num_reqs:
                tokens[:, step] = prev
                if q is not None:
                    probs[:, step] = q
            else:
                index = torch.tensor(active, dtype=torch.int64).to(self.device, non_blocking=True)
                tokens[index, step] = prev
                if q is not None:
                    probs[index, step] = q
            for b in active:
                counts[b] += 1
        for request in requests:
            state = self._seqs.get(request.seq_id)
            if state is not None:
                state.num_known = request.num_tokens
        host = tokens.to("cpu", non_blocking=True) if cuda else tokens
        ready = None
        if cuda:
            ready = torch.cuda.Event(enable_timing=timed)
            ready.record()
        rows = {r.seq_id: b for b, r in enumerate(requests)}
        drafts = DeviceDrafts(tokens, rows, counts, host, ready, start)
        self._unresolved = drafts
        return DraftProposals(
            token_ids=[[PLACEHOLDER_TOKEN_ID] * n for n in counts], probs=probs, device=drafts
        )

    def resolve(self) -> None:
        """Give the draft cache the ids of the drafts it was fed on the device (its records held
        placeholders, its blocks were not hashed): before the next catch-up compares them."""
        drafts, self._unresolved = self._unresolved, None
        if drafts is None:
            return
        lists = drafts.to_host()
        if drafts.start is not None:
            self.device_times_ms.append(drafts.start.elapsed_time(drafts.ready))
        for seq_id, first in list(self._placeholders.items()):
            if seq_id in self._chained:
                continue  # chained since: its records follow the accepted tokens (resolve_chained)
            del self._placeholders[seq_id]
            state = self._seqs.get(seq_id)
            if state is None:
                continue  # freed meanwhile
            fed = lists[seq_id][: len(state.cached_ids) - first]  # drafts 1..n-1 were fed
            state.cached_ids[first : first + len(fed)] = fed
            self.kv.set_tokens(seq_id, first, fed)
            self.kv.mark_computed([seq_id], [self._computed[seq_id]])

    def free(self, seq_id: int) -> None:
        if self._seqs.pop(seq_id, None) is not None:
            self._computed.pop(seq_id, None)
            self._placeholders.pop(seq_id, None)
            self._chained.discard(seq_id)
            self.kv.free(seq_id)

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
                state = self._seqs[seq_id] = _DraftSeq(target, len(tokens))
                self._computed[seq_id] = num_cached
            else:
                keep = _common_prefix(state.cached_ids, target, start=min(state.num_known, len(target)))
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
                prev = argmax_rows(_fit_vocab(logits, self.vocab_size), self.backend)  # [B]
            else:
                meta, first_positions = sampling
                if meta.seeded_rows is not None:
                    meta.positions = first_positions + step
                prev, probs[:, step] = self._draw_with_q(_fit_vocab(logits, self.vocab_size), meta)
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
            self._set_ids(seq_id, first, _span(prompt, output, first, num_known))
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
            self._set_ids(seq_id, first, _span(prompt, output, first, valid))
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

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            pairs = torch.tensor(copies, dtype=torch.int64, device=self.device)
            ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], pairs)

    # ---- cache bookkeeping ----------------------------------------------------------------------
    def _catch_up(self, request: DraftRequest) -> bool:
        """Make the draft cache hold a prefix of the sequence and room for the rest; False: no room."""
        tokens = request.token_ids()
        state = self._seqs.get(request.seq_id)
        if state is None:
            num_cached = self.kv.allocate(request.seq_id, tokens)
            if num_cached is None:
                return False
            self._seqs[request.seq_id] = _DraftSeq(list(tokens), len(tokens))
            self._computed[request.seq_id] = num_cached
            return True
        keep = _common_prefix(state.cached_ids, tokens, start=min(state.num_known, len(tokens)))
        keep = min(keep, len(tokens) - 1)  # at least one token to run: its logits give draft 1
        if keep < len(state.cached_ids):
            self.kv.truncate(request.seq_id, keep)
            del state.cached_ids[keep:]
        self._computed[request.seq_id] = keep
        return self._append(request.seq_id, tokens[keep:])

    def _append_fed(self, seq_id: int) -> bool:
        """Room for one draft fed on the device; its id is a placeholder until `resolve`."""
        self._placeholders.setdefault(seq_id, len(self._seqs[seq_id].cached_ids))
        return self._append(seq_id, [PLACEHOLDER_TOKEN_ID])

    def _append(self, seq_id: int, token_ids: list[int]) -> bool:
        copies = self.kv.append(seq_id, token_ids)
        if copies is None:  # the draft cache is full: stop drafting for this sequence
            self.free(seq_id)
            return False
        self._copy_blocks(copies)
        self._seqs[seq_id].cached_ids.extend(token_ids)
        return True

    # ---- model ----------------------------------------------------------------------------------
    def _forward(
        self, seq_ids: list[int], num_new: list[int], fed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the uncomputed tokens of each sequence; logits [A, V] at each one's last token.

        `fed` [A]: one new token a sequence, its id on the device (a device draft step); its
        blocks are hashed by `resolve` once the ids are known."""
        computed = [self._computed[s] for s in seq_ids]
        layout = self.kv.build_batch(seq_ids, computed, num_new)
        input_ids = [
            t
            for s, c, n in zip(seq_ids, computed, num_new, strict=True)
            for t in self._seqs[s].cached_ids[c : c + n]
        ]
        key = self.graphs.select(len(seq_ids), max(num_new)) if self.graphs is not None else None
        if key is not None:  # steady state: replay a captured graph on the padded static buffers
            last_rows = np.asarray(layout.query_start_loc[1:], dtype=np.int64) - 1  # [A]
            inputs = self.graphs.batch.stage(np.asarray(input_ids, dtype=np.int64), layout, last_rows, key)
            if fed is not None:
                self.graphs.batch.ids[: len(seq_ids)].copy_(fed)
            hidden = self.graphs.replay(key)  # [B * q, hidden]
            md = inputs.attn_metadata
        else:
            md = AttentionMetadata.from_batch(layout, self.device, backend=self.backend)
            if fed is not None:
                ids = fed
            else:
                ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)  # [T]
            hidden = self.model(ids, md.positions, self.kv_caches, md)  # [T, hidden]
        logits = self.model.compute_logits(hidden[md.logits_indices], backend=self.backend)  # [A, V_draft]
        for s, c, n in zip(seq_ids, computed, num_new, strict=True):
            self._computed[s] = c + n
        if fed is None:
            self.kv.mark_computed(seq_ids, [self._computed[s] for s in seq_ids])
        return _fit_vocab(logits, self.vocab_size)

    def _draw(
        self, logits: torch.Tensor, requests: list[DraftRequest], step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_sample` of history-free requests on the device: the drafts [A] at each row's output
        position + step (the draft ids before it are not needed: no penalties) and q [A, V]."""
        rows = [dataclasses.replace(r.row, output_position=r.row.output_position + step) for r in requests]
        meta = build_sampling_metadata(
            rows, self.vocab_size, self.device, [r.eos_token_ids for r in requests]
        )
        return self._draw_with_q(logits, meta)

    def _draw_with_q(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [A] drawn from processed logits [A, V] as the target would draw them, but with
        seeds salted (a draft's noise is not the target's at the same position: the rejection
        step's test would be biased otherwise), and their distributions q [A, V]."""
        processed = self.sampler.process(logits, meta)  # [A, V]
        if meta.seeds is not None:
            meta = dataclasses.replace(meta, seeds=meta.seeds ^ _DRAFT_SALT)
        return self.sampler.draw(processed, meta), processed.softmax(dim=-1)

    def _sample(
        self, logits: torch.Tensor, requests: list[DraftRequest], drafts: list[list[int]]
    ) -> tuple[list[int], torch.Tensor | None]:
        """Process like the target at each row's next output position; draw with salted noise.

        Returns the tokens and q [A, V] (None when every row is greedy: argmax needs no q)."""
        rows = [_position_row(r.row, d) for r, d in zip(requests, drafts, strict=True)]
        meta = build_sampling_metadata(
            rows, self.vocab_size, self.device, [r.eos_token_ids for r in requests]
        )
        if meta.all_greedy:
            return self.sampler.draw(self.sampler.process(logits, meta), meta).tolist(), None
        tokens, q = self._draw_with_q(logits, meta)
        return tokens.tolist(), q


def _position_row(row: SamplingRow, drafts: list[int]) -> SamplingRow:
    """The sampling row of the next draft: output position and penalty history past `drafts`."""
    if not drafts:
        return row
    history = [*row.output_token_ids[: row.output_position], *drafts]
    return dataclasses.replace(
        row, output_position=row.output_position + len(drafts), output_token_ids=history
    )


def _span(prompt: Sequence[int], output: Sequence[int], start: int, stop: int) -> list[int]:
    """Tokens [start, stop) of prompt + output, without joining the two."""
    n = len(prompt)
    if start >= n:
        return list(output[start - n : stop - n])
    return [*prompt[start:stop], *output[: max(stop - n, 0)]]


def _common_prefix(cached: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix; positions before `start` are known to agree."""
    limit = min(len(cached), len(tokens))
    i = min(start, limit)
    while i < limit and cached[i] == tokens[i]:
        i += 1
    return i


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits [A, V_draft] -> [A, V_target]: ids beyond the shared tokenizer never win."""
    if logits.shape[1] == vocab_size:
        return logits
    if logits.shape[1] > vocab_size:
        return logits[:, :vocab_size]
    pad = logits.new_full((logits.shape[0], vocab_size - logits.shape[1]), float("-inf"))
    return torch.cat([logits, pad], dim=1)
