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
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata


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
    ) -> None:
        self.device = device
        self.backend = backend
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        pin = device.type == "cuda"
        max_tokens = max(max_num_tokens, max_num_seqs)

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device)

        self.ids_host, self.ids_np, self.ids = pair(max_tokens, torch.int64)
        self.pos_host, self.pos_np, self.pos = pair(max_tokens, torch.int64)
        self.slots_host, self.slots_np, self.slots = pair(max_tokens, torch.int64)
        self.bt_host, self.bt_np, self.block_tables = pair((max_num_seqs, max_blocks_per_seq), torch.int32)
        self.lens_host, self.lens_np, self.seq_lens = pair(max_num_seqs, torch.int32)
        self.qsl_host, self.qsl_np, self.query_start_loc = pair(max_num_seqs + 1, torch.int32)
        self.li_host, self.li_np, self.logits_indices = pair(max_tokens, torch.int64)

    def prepare(self, sched: SchedulerOutput, logits_rows: np.ndarray, pad_seqs_to: int | None) -> StepInputs:
        """Fill buffers for the step; `pad_seqs_to` (pure decode only) pads to a graph bucket."""
        layout = sched.layout
        assert layout is not None
        num_seqs = len(sched.sequences)
        num_tokens = int(layout.slot_mapping.shape[0])
        padded_seqs = pad_seqs_to or num_seqs
        padded_tokens = pad_seqs_to or num_tokens
        ids = np.fromiter(
            itertools.chain.from_iterable(s.token_ids for s in sched.sequences), np.int64, num_tokens
        )
        self.ids_np[:num_tokens] = ids
        self.pos_np[:num_tokens] = layout.positions
        self.slots_np[:num_tokens] = layout.slot_mapping
        width = layout.block_tables.shape[1]
        self.bt_np[:num_seqs, :width] = layout.block_tables
        self.lens_np[:num_seqs] = layout.context_lens
        self.qsl_np[: num_seqs + 1] = layout.query_start_loc
        if padded_seqs > num_seqs:  # bucket padding: one token per fake sequence, scratch block
            self.ids_np[num_tokens:padded_tokens] = 0
            self.pos_np[num_tokens:padded_tokens] = 0
            self.slots_np[num_tokens:padded_tokens] = self.scratch_slot
            self.bt_np[num_seqs:padded_seqs, 0] = self.scratch_block
            self.lens_np[num_seqs:padded_seqs] = 1
            self.qsl_np[num_seqs + 1 : padded_seqs + 1] = np.arange(num_tokens + 1, padded_tokens + 1)
        num_logits = len(logits_rows)
        self.li_np[:num_logits] = logits_rows
        bt_width = self.max_blocks_per_seq if pad_seqs_to else width
        self._copy(padded_tokens, padded_seqs, num_logits)
        q_lens = np.diff(layout.query_start_loc)
        md = AttentionMetadata(
            slot_mapping=self.slots[:padded_tokens],
            positions=self.pos[:padded_tokens],
            block_tables=self.block_tables[:padded_seqs, :bt_width],
            query_start_loc=self.query_start_loc[: padded_seqs + 1],
            seq_lens=self.seq_lens[:padded_seqs],
            logits_indices=self.logits_indices[:num_logits],
            max_query_len=int(q_lens.max()),
            max_seq_len=int(layout.context_lens.max()),
            is_pure_decode=bool((q_lens == 1).all()),
            backend=self.backend,
        )
        return StepInputs(self.ids[:padded_tokens], self.pos[:padded_tokens], md, num_tokens, num_seqs)

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
