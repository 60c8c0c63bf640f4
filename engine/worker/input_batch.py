"""Persistent input buffers of the model runner: pinned host staging + device tensors.

Every step writes its flat inputs (token ids, positions, slots, block tables, lengths) into
preallocated pinned host buffers and copies them to fixed device buffers with non-blocking
copies. The device buffers double as the static inputs of captured CUDA graphs; rows beyond
the real batch (bucket padding) point at a scratch block so they never touch live KV.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagedinfer.engine.core.scheduler_output import SchedulerOutput
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata, BatchLayout


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64 (device)
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    num_tokens: int  # real tokens (T may be a padded bucket)
    num_seqs: int


class InputBatch:
    """Owns the staging/device buffers; `prepare()` fills them for one SchedulerOutput."""

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
        backend: str | None = None,
        num_staging_sets: int = 2,
    ) -> None:
        self.device = device
        self.backend = backend
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_blocks_per_seq * block_size  # what graphs are captured for
        self.max_num_tokens = max(max_num_tokens, max_num_seqs)
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        pin = device.type == "cuda"
        max_tokens = max(max_num_tokens, max_num_seqs)
        # Twice max_num_seqs sequence rows: verification graphs carry up to B pad sequences more.
        shapes = {
            "ids": (max_tokens, torch.int64),
            "pos": (max_tokens, torch.int64),
            "slots": (max_tokens, torch.int64),
            "bt": ((2 * max_num_seqs, max_blocks_per_seq), torch.int32),
            "lens": (2 * max_num_seqs, torch.int32),
            "qsl": (2 * max_num_seqs + 1, torch.int32),
            # Logits rows: one per token at most, plus a fork row per child (each holds a seat).
            "li": (max_tokens + max_num_seqs, torch.int64),
        }
        # Sets of pinned staging buffers, used in turn: with async scheduling a step is staged
        # while the copies of the step before may still be queued behind the running one (a
        # draft model staging its K steps of a chained launch at once wants more than two).
        self._staging = [
            {name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in shapes.items()}
            for _ in range(num_staging_sets)
        ]
        # Their numpy views, made once: `.numpy()` is four dispatcher calls a buffer, and a step
        # (a chained draft launch: two) switches sets every time it stages.
        self._staging_np = [{name: t.numpy() for name, t in host.items()} for host in self._staging]
        # After each set's copies: a set is reused only once they ran (a proposer that stages
        # several steps without waiting for the device could otherwise overwrite queued data).
        self._copied: list[torch.cuda.Event | None] = [None] * num_staging_sets
        self._staging_index = num_staging_sets - 1
        self._use_next_staging()
        (
            self.ids,
            self.pos,
            self.slots,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.logits_indices,
        ) = (torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes.values())

    def _use_next_staging(self) -> None:
        self._staging_index = (self._staging_index + 1) % len(self._staging)
        copied = self._copied[self._staging_index]
        if copied is not None:
            copied.synchronize()
        host, arrays = self._staging[self._staging_index], self._staging_np[self._staging_index]
        self.ids_host, self.pos_host, self.slots_host = host["ids"], host["pos"], host["slots"]
        self.bt_host, self.lens_host, self.qsl_host, self.li_host = (
            host["bt"],
            host["lens"],
            host["qsl"],
            host["li"],
        )
        self.ids_np, self.pos_np, self.slots_np = arrays["ids"], arrays["pos"], arrays["slots"]
        self.bt_np, self.lens_np, self.qsl_np, self.li_np = (
            arrays["bt"],
            arrays["lens"],
            arrays["qsl"],
            arrays["li"],
        )

    def prepare(self, sched: SchedulerOutput, logits_rows: np.ndarray, graph=None) -> StepInputs:
        """Fill buffers for the step; `graph` (a cuda_graphs.GraphKey) pads to a captured shape."""
        layout = sched.layout
        assert layout is not None
        num_tokens = int(layout.slot_mapping.shape[0])
        if sched.feeds_drafts:  # a chained step's ids are written on the device (device_chain.py)
            ids = np.zeros(num_tokens, np.int64)
            admitted = sched.sequences[sched.num_fed :]  # prompts admitted behind: real inputs
            if admitted:
                tail = list(itertools.chain.from_iterable(s.token_ids for s in admitted))
                ids[num_tokens - len(tail) :] = tail
        else:
            ids = np.fromiter(
                itertools.chain.from_iterable(s.token_ids for s in sched.sequences), np.int64, num_tokens
            )
        return self.stage(ids, layout, logits_rows, graph)

    def stage(self, ids: np.ndarray, layout: BatchLayout, logits_rows: np.ndarray, graph=None) -> StepInputs:
        """Token ids [T] + a block manager's layout -> device inputs (padded to `graph` if given).

        Padding for a graph of (B, q): the token rows up to B * q go to pad sequences in the scratch
        block, at most q rows each (so max_query_len = q holds and query_start_loc ends at the row
        count); decode graphs (q = 1) have B sequence rows, verification graphs 2B: enough pad
        sequences for any step of <= B sequences of 1..q tokens.
        """
        self._use_next_staging()
        num_seqs = int(layout.context_lens.shape[0])
        num_tokens = int(layout.slot_mapping.shape[0])
        padded_seqs = graph.num_seq_rows if graph is not None else num_seqs
        padded_tokens = graph.num_tokens if graph is not None else num_tokens
        self.ids_np[:num_tokens] = ids
        self.pos_np[:num_tokens] = layout.positions
        self.slots_np[:num_tokens] = layout.slot_mapping
        width = layout.block_tables.shape[1]
        self.bt_np[:num_seqs, :width] = layout.block_tables
        self.lens_np[:num_seqs] = layout.context_lens
        self.qsl_np[: num_seqs + 1] = layout.query_start_loc
        if graph is not None:
            self._pad(graph, num_seqs, num_tokens)
        num_logits = len(logits_rows)
        self.li_np[:num_logits] = logits_rows
        self._copy(padded_tokens, padded_seqs, num_logits)
        if graph is not None:
            md = self.graph_metadata(graph)
            md.logits_indices = self.logits_indices[:num_logits]
        else:
            q_lens = np.diff(layout.query_start_loc)
            md = AttentionMetadata(
                slot_mapping=self.slots[:num_tokens],
                positions=self.pos[:num_tokens],
                block_tables=self.block_tables[:num_seqs, :width],
                query_start_loc=self.query_start_loc[: num_seqs + 1],
                seq_lens=self.seq_lens[:num_seqs],
                logits_indices=self.logits_indices[:num_logits],
                max_query_len=int(q_lens.max()),
                max_seq_len=int(layout.context_lens.max()),
                is_pure_decode=bool((q_lens == 1).all()),
                backend=self.backend,
            )
        return StepInputs(self.ids[:padded_tokens], self.pos[:padded_tokens], md, num_tokens, num_seqs)

    def _pad(self, graph, num_seqs: int, num_tokens: int) -> None:
        """Scratch-block padding up to the graph's shape (see `stage`)."""
        num_pad_seqs = graph.num_seq_rows - num_seqs
        num_pad_tokens = graph.num_tokens - num_tokens
        # Pad sequences take up to q rows each, in order: [q, q, ..., rest, 0, 0, ...].
        q_lens = np.clip(
            num_pad_tokens - graph.query_len * np.arange(max(num_pad_seqs, 0)), 0, graph.query_len
        )
        if (
            num_pad_seqs < 0
            or int(q_lens.sum()) != num_pad_tokens
            or (graph.query_len == 1 and q_lens.min(initial=1) < 1)
        ):
            raise ValueError(f"{num_seqs} sequences / {num_tokens} tokens do not fit graph {graph}")
        rows = slice(num_seqs, graph.num_seq_rows)
        self.ids_np[num_tokens : graph.num_tokens] = 0
        self.pos_np[num_tokens : graph.num_tokens] = np.concatenate([np.arange(n) for n in q_lens] or [[]])
        self.slots_np[num_tokens : graph.num_tokens] = self.scratch_slot
        self.bt_np[rows] = self.scratch_block
        self.lens_np[rows] = np.maximum(q_lens, 1)
        self.qsl_np[num_seqs + 1 : graph.num_seq_rows + 1] = num_tokens + np.cumsum(q_lens)

    def graph_metadata(self, graph) -> AttentionMetadata:
        """Metadata over the static buffers for a captured shape (full block-table width)."""
        rows = graph.num_seq_rows
        return AttentionMetadata(
            slot_mapping=self.slots[: graph.num_tokens],
            positions=self.pos[: graph.num_tokens],
            block_tables=self.block_tables[:rows, : self.max_blocks_per_seq],
            query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            logits_indices=self.logits_indices[: graph.num_seqs],
            max_query_len=graph.query_len,
            max_seq_len=self.max_seq_len,
            is_pure_decode=graph.query_len == 1,
            backend=self.backend,
            max_seq_len_exact=False,
        )

    def _copy(self, num_tokens: int, num_seqs: int, num_logits: int) -> None:
        for host, dev, n in (
            (self.ids_host, self.ids, num_tokens),
            (self.pos_host, self.pos, num_tokens),
            (self.slots_host, self.slots, num_tokens),
            (self.lens_host, self.seq_lens, num_seqs),
            (self.qsl_host, self.query_start_loc, num_seqs + 1),
            (self.li_host, self.logits_indices, num_logits),
        ):
            dev[:n].copy_(host[:n], non_blocking=True)
        self.block_tables[:num_seqs].copy_(self.bt_host[:num_seqs], non_blocking=True)
        if self.ids.is_cuda:
            event = self._copied[self._staging_index] or torch.cuda.Event()
            event.record()
            self._copied[self._staging_index] = event
