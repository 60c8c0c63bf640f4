"""Per-step attention metadata: every index tensor one forward pass of a ragged batch needs.

Built once per step by the model runner and passed down explicitly through the model to each
attention layer (there is no global attention context). One step may mix prefill chunks, decode
tokens and speculative verification tokens: the new tokens of all sequences are concatenated.

Vocabulary: T = number of new tokens in the step, B = number of sequences, slot =
block_id * block_size + offset. `seq_lens[b]` counts cached + new tokens of sequence b.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class BatchLayout(Protocol):
    """What `BlockManager.build_batch` (native) and `block_pool_ref` return: numpy int32 arrays."""

    block_tables: np.ndarray  # [B, max_blocks]
    slot_mapping: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    context_lens: np.ndarray  # [B] cached + new
    query_start_loc: np.ndarray  # [B + 1]


@dataclass
class AttentionMetadata:
    """Index tensors of one forward step, all on the model's device.

    `is_pure_decode` (every sequence has exactly one new token) selects the decode kernel;
    otherwise the extend kernel handles any mix of query lengths. `max_query_len` and
    `max_seq_len` are host ints so no kernel launch needs a device sync to size its grid.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32: token offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [B] int32: cached + new tokens of each sequence
    logits_indices: torch.Tensor  # [N] int64: the token rows whose logits are needed
    max_query_len: int
    max_seq_len: int
    is_pure_decode: bool
    backend: str | None = None  # attention backend: None/"auto", "triton" or "reference"
    # max_seq_len is this batch's longest context (eager), not just the tables' capacity (graphs):
    # only then may the decode kernel size its splits from it
    max_seq_len_exact: bool = True

    @property
    def context_lens(self) -> torch.Tensor:
        """Alias of `seq_lens` under the decode kernel's name (cached + new)."""
        return self.seq_lens

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def from_batch(
        cls,
        batch: BatchLayout,
        device: torch.device | str,
        logits_indices: np.ndarray | torch.Tensor | None = None,
        backend: str | None = None,
    ) -> AttentionMetadata:
        """Tensors from a block manager's batch layout.

        `logits_indices` defaults to the last new token of every sequence (what sampling needs);
        pass explicit rows for speculative verification or prompt logprobs.
        """
        query_start_loc = np.asarray(batch.query_start_loc, dtype=np.int32)  # [B + 1]
        seq_lens = np.asarray(batch.context_lens, dtype=np.int32)  # [B]
        q_lens = np.diff(query_start_loc)  # [B]
        if logits_indices is None:
            logits_indices = query_start_loc[1:].astype(np.int64) - 1  # [B]
        num_seqs = int(seq_lens.shape[0])
        return cls(
            slot_mapping=_to_device(batch.slot_mapping, torch.int64, device),
            positions=_to_device(batch.positions, torch.int64, device),
            block_tables=_to_device(batch.block_tables, torch.int32, device),
            query_start_loc=_to_device(query_start_loc, torch.int32, device),
            seq_lens=_to_device(seq_lens, torch.int32, device),
            logits_indices=_to_device(logits_indices, torch.int64, device),
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
            is_pure_decode=bool(num_seqs > 0 and (q_lens == 1).all()),
            backend=backend,
        )


def _to_device(array: np.ndarray | torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    tensor = torch.as_tensor(np.asarray(array) if not isinstance(array, torch.Tensor) else array)
    tensor = tensor.to(dtype)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
