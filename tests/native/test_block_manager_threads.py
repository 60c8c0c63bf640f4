"""The native manager releases the GIL in bulk calls; its mutex must keep concurrent use safe."""

from __future__ import annotations

import threading

import numpy as np

from pagedinfer._native import BlockManager


def test_concurrent_build_batch_and_appends_stay_consistent() -> None:
    bm = BlockManager(16384, 16)
    num_seqs = 256  # large enough that the batch calls release the GIL
    for seq_id in range(num_seqs):
        bm.add_sequence(seq_id, np.arange(600, dtype=np.int32))
    ids = np.arange(num_seqs, dtype=np.int64)
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                lens = np.array([bm.num_tokens(int(i)) for i in ids], dtype=np.int32)
                out = bm.build_batch(ids, lens - 1, np.ones(num_seqs, np.int32))
                # Each slot points into the block the table names for that position.
                blocks = out.block_tables[np.arange(num_seqs), out.positions // 16]
                assert np.array_equal(out.slot_mapping, blocks * 16 + out.positions % 16)
                bm.mark_computed(ids, np.zeros(num_seqs, np.int32))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for step in range(100):
        bm.append_tokens_batch(ids, np.full(num_seqs, step, np.int32), np.ones(num_seqs, np.int32))
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    bm.check_invariants()
    assert all(bm.num_tokens(int(i)) == 700 for i in ids)
