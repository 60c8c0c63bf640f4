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

import numpy as np
import torch

from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.lookahead import PLACEHOLDER_TOKEN_ID
from pagedinfer.engine.sample.metadata import (
    SamplingMetadata,
    SamplingMetadataBuilder,
    build_sampling_metadata,
)
from pagedinfer.engine.sample.sampler import Sampler
from pagedinfer.engine.spec_decode.draft_chain import DraftChains
from pagedinfer.engine.spec_decode.draft_records import DraftSeq, common_prefix, fit_vocab, position_row
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


class DraftModelProposer(DraftChains):
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
        self._seqs: dict[int, DraftSeq] = {}
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
            self._seqs[request.seq_id] = DraftSeq(list(tokens), len(tokens))
            self._computed[request.seq_id] = num_cached
            return True
        keep = common_prefix(state.cached_ids, tokens, start=min(state.num_known, len(tokens)))
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
        return fit_vocab(logits, self.vocab_size)

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
        rows = [position_row(r.row, d) for r, d in zip(requests, drafts, strict=True)]
        meta = build_sampling_metadata(
            rows, self.vocab_size, self.device, [r.eos_token_ids for r in requests]
        )
        if meta.all_greedy:
            return self.sampler.draw(self.sampler.process(logits, meta), meta).tolist(), None
        tokens, q = self._draw_with_q(logits, meta)
        return tokens.tolist(), q
