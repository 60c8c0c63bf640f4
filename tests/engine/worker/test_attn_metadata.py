"""AttentionMetadata from a block manager's batch layout."""

from __future__ import annotations

import numpy as np
import torch

from pagedinfer._native import BlockManager
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata


def test_from_native_batch_mixed_step():
    bm = BlockManager(16, 4, True)
    bm.add_sequence(0, np.arange(10, dtype=np.int32))
    bm.add_sequence(1, np.arange(100, 103, dtype=np.int32))
    batch = bm.build_batch(np.array([0, 1], np.int64), np.array([9, 0], np.int32), np.array([1, 3], np.int32))
    md = AttentionMetadata.from_batch(batch, "cpu")
    assert md.slot_mapping.dtype == md.positions.dtype == md.logits_indices.dtype == torch.int64
    assert md.block_tables.dtype == md.seq_lens.dtype == md.query_start_loc.dtype == torch.int32
    assert md.positions.tolist() == [9, 0, 1, 2]
    assert md.query_start_loc.tolist() == [0, 1, 4]
    assert md.seq_lens.tolist() == md.context_lens.tolist() == [10, 3]
    assert md.logits_indices.tolist() == [0, 3]  # the last new token of each sequence
    assert (md.max_query_len, md.max_seq_len, md.is_pure_decode) == (3, 10, False)
    assert (md.num_tokens, md.num_seqs) == (4, 2)
    block_of_pos9 = int(md.block_tables[0, 2])
    assert int(md.slot_mapping[0]) == block_of_pos9 * 4 + 1


def test_pure_decode_and_explicit_logit_rows():
    bm = BlockManager(8, 4, True)
    for s in range(3):
        bm.add_sequence(s, np.arange(5 + s, dtype=np.int32))
    batch = bm.build_batch(np.arange(3, dtype=np.int64), np.array([4, 5, 6], np.int32), np.ones(3, np.int32))
    md = AttentionMetadata.from_batch(batch, "cpu", logits_indices=np.array([2, 0]), backend="reference")
    assert md.is_pure_decode and md.max_query_len == 1 and md.backend == "reference"
    assert md.logits_indices.tolist() == [2, 0]
