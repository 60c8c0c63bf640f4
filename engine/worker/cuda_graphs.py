"""CUDA graphs for decode and verification steps, one per (batch-size bucket, query length).

A graph keyed (B, q) takes up to B sequences of at most q new tokens each (B * q token rows):
q = 1 is a pure-decode step (decode kernel), q = 1 + K a speculative verification step (extend
kernel with a fixed max_query_len; it reads query_start_loc / seq_lens from the device, so one
graph serves any mix of query lengths <= q). Its inputs are the `InputBatch` device buffers
(static addresses); unused rows go to pad sequences in a scratch block (their hidden rows are
never read).
Prefills, larger steps, and every step on the CPU run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from pagedinfer.engine.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class GraphKey:
    """One captured graph: up to `num_seqs` sequences of up to `query_len` new tokens each."""

    num_seqs: int
    query_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.query_len

    @property
    def num_seq_rows(self) -> int:
        """Sequence rows: B for decode; 2B for verification (pad sequences for unused rows)."""
        return self.num_seqs if self.query_len == 1 else 2 * self.num_seqs


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM's spacing, coarser)."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    buckets += list(range(16, max_num_seqs + 1, 16))
    if not buckets or buckets[-1] != max_num_seqs:
        buckets.append(max_num_seqs)
    return sorted(set(buckets))


def graph_keys(
    buckets: Sequence[int], query_lens: Sequence[int], max_num_tokens: int, max_verify_seqs: int | None = None
) -> list[GraphKey]:
    """Keys to capture: every bucket at q = 1; at q > 1 the buckets up to `max_verify_seqs`
    (speculation is off above it) whose B * q rows fit the input buffers."""
    keys = []
    for q in sorted(set(query_lens)):
        for b in buckets:
            if q > 1 and max_verify_seqs is not None and b > max_verify_seqs:
                continue
            if b * q <= max_num_tokens:
                keys.append(GraphKey(b, q))
    return keys


def select_key(keys: Sequence[GraphKey], num_seqs: int, max_query_len: int) -> GraphKey | None:
    """The cheapest captured graph for a step: smallest q >= the step's longest query, then the
    smallest bucket >= num_seqs; None (eager) when nothing fits. `keys` is sorted."""
    if num_seqs < 1 or max_query_len < 1:
        return None
    for q in sorted({k.query_len for k in keys}):
        if q < max_query_len:
            continue
        buckets = [k.num_seqs for k in keys if k.query_len == q]
        i = bisect.bisect_left(buckets, num_seqs)
        if i < len(buckets):
            return GraphKey(buckets[i], q)
        return None  # a longer q would only pad more; same bucket limits
    return None


class CudaGraphRunner:
    """Captures `model(...)` for each key and replays it; `None` from `select` = eager."""

    def __init__(self, model, kv_caches, batch: InputBatch, keys: Sequence[GraphKey]) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.batch = batch
        self.keys = sorted(keys)
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[GraphKey, torch.Tensor] = {}
        self._pool = None
        self._captured: list[GraphKey] = []  # sorted; looked up every step

    @property
    def captured(self) -> list[GraphKey]:
        if len(self._captured) != len(self._graphs):
            self._captured = sorted(self._graphs)
        return self._captured

    def select(self, num_seqs: int, max_query_len: int) -> GraphKey | None:
        return select_key(self.captured, num_seqs, max_query_len)

    def bucket_for(self, num_seqs: int) -> int | None:
        """Decode bucket for num_seqs sequences (None: eager)."""
        key = self.select(num_seqs, 1)
        return key.num_seqs if key is not None and key.query_len == 1 else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every key, largest first so smaller graphs reuse its memory pool."""
        b = self.batch
        b.block_tables.fill_(b.scratch_block)
        empty = np.zeros(0, dtype=np.int32)
        layout = SimpleNamespace(
            block_tables=np.zeros((0, 1), dtype=np.int32),
            slot_mapping=empty,
            positions=empty,
            context_lens=empty,
            query_start_loc=np.zeros(1, dtype=np.int32),
        )
        for key in sorted(self.keys, key=lambda k: (k.num_tokens, k), reverse=True):
            # Captured on an all-padding batch: the same layout a real step is padded to.
            md = b.stage(np.zeros(0, dtype=np.int64), layout, np.zeros(0, dtype=np.int64), key).attn_metadata
            ids, pos = b.ids[: key.num_tokens], b.pos[: key.num_tokens]
            for _ in range(2):  # warm up: Triton autotune / compile outside the capture
                self.model(ids, pos, self.kv_caches, md)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.model(ids, pos, self.kv_caches, md)
            self._pool = graph.pool()
            self._graphs[key] = graph
            self._outputs[key] = out
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs (batch, query_len): %s", [(k.num_seqs, k.query_len) for k in self.keys]
        )

    def replay(self, key: GraphKey) -> torch.Tensor:
        """hidden [B * q, H] for the inputs already staged in the batch buffers."""
        self._graphs[key].replay()
        return self._outputs[key]
