"""CUDA graphs for pure-decode steps, one per batch-size bucket.

A decode step of B sequences replays the graph of the smallest bucket >= B; its inputs are
the `InputBatch` device buffers (static addresses), padded rows point at a scratch block.
Prefill / mixed steps, and every step on the CPU, run eagerly.
"""

from __future__ import annotations

import bisect
import logging

import torch

from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.engine.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM's spacing, coarser)."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    buckets += list(range(16, max_num_seqs + 1, 16))
    if not buckets or buckets[-1] != max_num_seqs:
        buckets.append(max_num_seqs)
    return sorted(set(buckets))


class CudaGraphRunner:
    """Captures `model(...)` for each bucket and replays it; `None` from `bucket_for` = eager."""

    def __init__(self, model, kv_caches, batch: InputBatch, buckets: list[int], max_seq_len: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.batch = batch
        self.buckets = buckets
        self.max_seq_len = max_seq_len
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    def bucket_for(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_seqs)
        if i == len(self.buckets) or self.buckets[i] not in self._graphs:
            return None
        return self.buckets[i]

    def _metadata(self, bucket: int) -> AttentionMetadata:
        b = self.batch
        return AttentionMetadata(
            slot_mapping=b.slots[:bucket],
            positions=b.pos[:bucket],
            block_tables=b.block_tables[:bucket, : b.max_blocks_per_seq],
            query_start_loc=b.query_start_loc[: bucket + 1],
            seq_lens=b.seq_lens[:bucket],
            logits_indices=b.logits_indices[:bucket],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            is_pure_decode=True,
            backend=b.backend,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        b = self.batch
        b.slots.fill_(b.scratch_slot)
        b.block_tables.fill_(b.scratch_block)
        b.seq_lens.fill_(1)
        b.query_start_loc.copy_(torch.arange(b.query_start_loc.shape[0], dtype=torch.int32))
        b.ids.zero_()
        b.pos.zero_()
        for bucket in sorted(self.buckets, reverse=True):
            md = self._metadata(bucket)
            ids, pos = b.ids[:bucket], b.pos[:bucket]
            for _ in range(2):  # warm up: Triton autotune / compile outside the capture
                self.model(ids, pos, self.kv_caches, md)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.model(ids, pos, self.kv_caches, md)
            self._pool = graph.pool()
            self._graphs[bucket] = graph
            self._outputs[bucket] = out
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def replay(self, bucket: int) -> torch.Tensor:
        """hidden [bucket, H] for the inputs already staged in the batch buffers."""
        self._graphs[bucket].replay()
        return self._outputs[bucket]
