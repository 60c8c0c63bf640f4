"""Semantics of the block manager, run against the native core and the Python reference."""

from __future__ import annotations

import numpy as np
import pytest

from pagedinfer import _native
from pagedinfer.engine.core import block_pool_ref as ref

IMPLS = {"native": _native, "ref": ref}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def test_add_allocates_blocks_for_all_tokens(impl) -> None:
    bm = impl.BlockManager(8, 4)
    assert bm.add_sequence(1, list(range(10))) == 0
    assert bm.block_table(1).tolist() == [0, 1, 2]
    assert bm.num_tokens(1) == 10 and bm.token_ids(1).tolist() == list(range(10))
    assert bm.num_free_blocks == 5 and bm.num_total_blocks == 8 and bm.block_size == 4
    assert bm.add_sequence(2, np.arange(3, dtype=np.int32)) == 0 and bm.block_table(2).tolist() == [3]
    bm.check_invariants()


def test_out_of_blocks_leaves_state_unchanged(impl) -> None:
    bm = impl.BlockManager(4, 4)
    bm.add_sequence(1, list(range(9)))  # 3 blocks
    before = (bm.stats(), bm.block_table(1).tolist())
    assert not bm.can_allocate(5) and bm.can_allocate(4)
    with pytest.raises(impl.OutOfBlocksError):
        bm.add_sequence(2, list(range(5)))
    bm.append_tokens(1, [1, 2, 3])  # fills block 2
    with pytest.raises(impl.OutOfBlocksError):
        bm.append_tokens(1, [0] * 5)
    assert bm.block_table(1).tolist() == before[1] + [] and bm.num_tokens(1) == 12
    assert not bm.has_sequence(2) and bm.stats()["num_sequences"] == 1
    bm.check_invariants()


def test_fork_then_append_copies_partial_last_block(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, [1, 2, 3, 4, 5, 6])  # blocks 0, 1 (half full)
    bm.fork(1, 2)
    assert bm.block_refcount(0) == 2 and bm.block_refcount(1) == 2
    assert bm.blocks_needed_to_append(2, 1) == 1  # the copy-on-write block
    assert bm.blocks_needed_to_append(2, 3) == 2
    assert bm.append_tokens(2, [9]) == [(1, 2)]
    assert bm.block_table(2).tolist() == [0, 2] and bm.block_refcount(1) == 1
    assert bm.append_tokens(1, [7]) == []  # block 1 is exclusive again: written in place
    assert bm.token_ids(1).tolist()[-2:] == [6, 7] and bm.token_ids(2).tolist()[-2:] == [6, 9]
    assert bm.stats()["cow_copies"] == 1
    bm.check_invariants()


def test_batch_need_counts_one_copy_fewer_than_the_holders_that_write(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, [1, 2, 3, 4, 5, 6])  # blocks 0, 1 (half full)
    bm.fork(1, 2)
    bm.fork(1, 3)
    # Each alone would copy block 1; of three writers two copy and the last writes in place.
    assert [bm.blocks_needed_to_append(i, 1) for i in (1, 2, 3)] == [1, 1, 1]
    assert bm.blocks_needed_to_append_batch([1, 2, 3], [1, 1, 1]) == 2
    assert bm.blocks_needed_to_append_batch([2, 3], [1, 3]) == 3  # two copies, one new block
    assert bm.blocks_needed_to_append_batch([2, 3], [0, 0]) == 0
    free = bm.num_free_blocks
    bm.append_tokens_batch([1, 2, 3], [7, 8, 9], [1, 1, 1])
    assert free - bm.num_free_blocks == 2
    with pytest.raises(ValueError):
        bm.blocks_needed_to_append_batch([1, 1], [1, 1])
    with pytest.raises(ValueError):
        bm.blocks_needed_to_append_batch([1], [-1])
    for ids in ([99], [1, 99, 1]):  # an unknown id first, as both implementations check in order
        with pytest.raises(impl.UnknownSequenceError):
            bm.blocks_needed_to_append_batch(ids, [-1] * len(ids))
        with pytest.raises(impl.UnknownSequenceError):
            bm.append_tokens_batch(ids, [7] * len(ids), [1] * len(ids))
    for check in (bm.blocks_needed_to_append_batch, lambda i, n: bm.append_tokens_batch(i, [7] * 3, n)):
        with pytest.raises(ValueError, match="twice"):  # a repeat before an unknown id
            check([1, 1, 99], [1, 1, 1])
    bm.check_invariants()


def test_set_last_tokens_reports_the_first_bad_id_in_order(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, [1, 2, 3])
    bm.add_sequence(2, [4, 5])
    with pytest.raises(impl.UnknownSequenceError):  # the unknown id before the repeat
        bm.set_last_tokens(ids(1, 99, 1), i32(7, 7, 7))
    with pytest.raises(ValueError, match="twice"):  # the repeat before the unknown id
        bm.set_last_tokens(ids(1, 1, 99), i32(7, 7, 7))
    assert bm.token_ids(1).tolist() == [1, 2, 3]  # all or nothing
    bm.set_last_tokens(ids(2, 1), i32(8, 9))
    assert bm.token_ids(1).tolist() == [1, 2, 9] and bm.token_ids(2).tolist() == [4, 8]
    bm.check_invariants()


def test_fork_of_full_last_block_needs_no_copy(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, [1, 2, 3, 4])
    bm.fork(1, 2)
    assert bm.blocks_needed_to_append(2, 1) == 1
    assert bm.append_tokens(2, [5]) == [] and bm.block_table(2).tolist() == [0, 1]


def test_prefix_reuse_only_after_mark_computed(impl) -> None:
    bm = impl.BlockManager(16, 4)
    prompt = list(range(10))
    bm.add_sequence(1, prompt)
    assert bm.add_sequence(2, prompt) == 0  # nothing computed yet: K/V not on the device
    bm.mark_computed(ids(1), i32(10))
    assert bm.add_sequence(3, prompt) == 8  # two full blocks; the partial third is not cached
    assert bm.block_table(3).tolist()[:2] == bm.block_table(1).tolist()[:2]
    assert bm.block_refcount(bm.block_table(1)[0]) == 2
    assert bm.add_sequence(4, prompt[:8]) == 8  # a full hit may cover every token
    assert bm.add_sequence(5, [0, 1, 2, 3, 9, 9, 9, 9]) == 4
    s = bm.stats()
    assert s["prefix_cache_hits"] == 20 and s["prefix_cache_queries"] == 46
    assert s["prefix_cache_hit_rate"] == pytest.approx(20 / 46)
    bm.check_invariants()


def test_freed_cached_blocks_are_evictable_lru(impl) -> None:
    bm = impl.BlockManager(4, 2)
    bm.add_sequence(1, [1, 2, 3, 4])
    bm.mark_computed([1], [4])
    bm.free(1)
    s = bm.stats()
    assert s["cached_blocks"] == 2 and s["free_blocks"] == 2 and bm.num_free_blocks == 4
    assert bm.add_sequence(2, [1, 2, 3, 4, 5]) == 4  # revived from the evictable set
    bm.free(2)
    bm.add_sequence(3, [7, 7, 7, 7, 7, 7])  # 2 free blocks, then evicts the LRU block
    assert bm.stats()["evictions"] == 1
    bm.free(3)
    # The chain's tail was released (so evicted) first; its head is still cached.
    assert bm.add_sequence(4, [1, 2, 3, 4]) == 2
    bm.check_invariants()


def test_modified_cached_block_is_never_served(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8])
    bm.mark_computed([1], [8])
    bm.truncate(1, 6)  # into the middle of a cached block, held by this sequence only
    bm.append_tokens(1, [0, 0])  # in place: the block must leave the cache
    assert bm.add_sequence(2, [1, 2, 3, 4, 5, 6, 7, 8]) == 4
    assert bm.token_ids(2).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    bm.mark_computed([1], [8])
    assert bm.add_sequence(3, [1, 2, 3, 4, 5, 6, 0, 0]) == 8
    bm.check_invariants()


def test_truncate_into_shared_cached_block_copies_on_append(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8])
    bm.mark_computed([1], [8])
    assert bm.add_sequence(2, [1, 2, 3, 4, 5, 6, 7, 8]) == 8
    assert bm.truncate(2, 5) == []
    assert bm.block_table(2).tolist() == [0, 1]
    assert bm.append_tokens(2, [9]) == [(1, 2)]
    assert bm.token_ids(1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert bm.add_sequence(3, [1, 2, 3, 4, 5, 6, 7, 8]) == 8  # cache still intact
    bm.check_invariants()


def test_truncate_frees_whole_blocks(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, list(range(13)))
    assert bm.num_free_blocks == 4
    bm.truncate(1, 5)
    assert bm.block_table(1).tolist() == [0, 1] and bm.num_free_blocks == 6
    bm.truncate(1, 0)
    assert bm.block_table(1).tolist() == [] and bm.num_free_blocks == 8
    bm.append_tokens(1, [1])
    assert bm.num_tokens(1) == 1


def test_identical_prompts_converge_on_one_chain(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, list(range(8)))
    bm.add_sequence(2, list(range(8)))  # before 1 is computed: separate blocks
    bm.mark_computed(ids(1, 2), i32(8, 8))
    assert bm.block_table(2).tolist() == bm.block_table(1).tolist()
    assert bm.stats()["used_blocks"] == 2 and bm.num_free_blocks == 6
    bm.check_invariants()


def test_build_batch_layout(impl) -> None:
    bm = impl.BlockManager(16, 4)
    bm.add_sequence(1, list(range(10)))  # blocks 0 1 2
    bm.add_sequence(2, list(range(3)))  # block 3
    out = bm.build_batch(ids(1, 2), i32(8, 0), i32(2, 3))
    assert out.block_tables.dtype == np.int32 and out.block_tables.tolist() == [[0, 1, 2], [3, 0, 0]]
    assert out.slot_mapping.tolist() == [8 + 0, 8 + 1, 12, 13, 14]
    assert out.positions.tolist() == [8, 9, 0, 1, 2]
    assert out.context_lens.tolist() == [10, 3] and out.query_start_loc.tolist() == [0, 2, 5]
    wide = bm.build_batch(ids(1), i32(0), i32(5), max_blocks=6)
    assert wide.block_tables.tolist() == [[0, 1, 0, 0, 0, 0]]  # only blocks up to the context
    assert bm.build_batch(ids(), i32(), i32()).block_tables.shape == (0, 0)


@pytest.mark.parametrize(
    ("computed", "new", "max_blocks"), [(9, 2, None), (-1, 1, None), (0, -1, None), (0, 10, 2)]
)
def test_build_batch_rejects_bad_rows(impl, computed: int, new: int, max_blocks) -> None:
    bm = impl.BlockManager(16, 4)
    bm.add_sequence(1, list(range(10)))
    with pytest.raises(ValueError):
        bm.build_batch(ids(1), i32(computed), i32(new), max_blocks)
    with pytest.raises(ValueError):
        bm.build_batch(ids(1, 2), i32(0, 0), i32(1, 1))  # unknown id
    with pytest.raises(ValueError):
        bm.build_batch(ids(1), i32(0, 0), i32(1))  # ragged


def test_errors_are_typed(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, [1, 2, 3])
    with pytest.raises(ValueError):
        bm.add_sequence(1, [1])
    with pytest.raises(ValueError):
        bm.fork(1, 1)
    for call in (lambda: bm.free(7), lambda: bm.append_tokens(7, [1]), lambda: bm.num_tokens(7)):
        with pytest.raises(KeyError):
            call()
    with pytest.raises(ValueError):
        bm.truncate(1, 4)
    with pytest.raises(ValueError):
        bm.truncate(1, -1)
    with pytest.raises(ValueError):
        bm.mark_computed([1], [4])
    with pytest.raises(ValueError):
        bm.add_sequence(2, [2**31])
    with pytest.raises(TypeError):
        bm.add_sequence(2, np.array([1.5]))
    with pytest.raises(IndexError):
        bm.block_refcount(8)
    bm.free(1)
    with pytest.raises(KeyError):
        bm.free(1)  # double free
    assert bm.num_free_blocks == 8
    for bad in ((0, 4), (4, 0), (2**28, 16)):
        with pytest.raises(ValueError):
            impl.BlockManager(*bad)


def test_stats_fragmentation_and_occupancy(impl) -> None:
    bm = impl.BlockManager(10, 4)
    bm.add_sequence(1, list(range(5)))  # 2 blocks, 5 of 8 slots
    bm.fork(1, 2)  # shared: still 5 distinct tokens stored
    s = bm.stats()
    assert s["used_blocks"] == 2 and s["occupancy"] == pytest.approx(0.2)
    assert s["fragmentation_ratio"] == pytest.approx(1 - 5 / 8)
    assert s["num_sequences"] == 2 and s["total_blocks"] == 10


def test_disabled_prefix_caching(impl) -> None:
    bm = impl.BlockManager(8, 4, enable_prefix_caching=False)
    bm.add_sequence(1, list(range(8)))
    bm.mark_computed([1], [8])
    assert bm.add_sequence(2, list(range(8))) == 0
    bm.free(1)
    assert bm.stats()["cached_blocks"] == 0 and bm.stats()["prefix_cache_queries"] == 0


def test_append_tokens_batch_counts_shared_writers_exactly(impl) -> None:
    bm = impl.BlockManager(5, 4)
    bm.add_sequence(1, [1, 2, 3, 4, 5, 6])  # blocks 0, 1 (half full)
    bm.fork(1, 2)
    bm.fork(1, 3)  # block 1 has 3 holders
    # Three writers into block 1: two copy, the last writes in place. 2 copies <= 3 free blocks.
    copies = bm.append_tokens_batch(ids(1, 2, 3), [7, 8, 9], i32(1, 1, 1))
    assert copies == [(1, 2), (1, 3)]
    assert bm.block_table(3).tolist() == [0, 1] and bm.token_ids(3).tolist()[-1] == 9
    assert [bm.token_ids(i).tolist()[-1] for i in (1, 2)] == [7, 8]
    with pytest.raises(impl.OutOfBlocksError):
        bm.append_tokens_batch(ids(1, 2), [0] * 6, i32(3, 3))  # 2 new blocks, 1 left
    assert bm.num_tokens(1) == 7 and bm.num_tokens(2) == 7  # all or nothing
    with pytest.raises(ValueError):
        bm.append_tokens_batch(ids(1, 1), [0, 0], i32(1, 1))  # duplicate id
    with pytest.raises(ValueError):
        bm.append_tokens_batch(ids(1), [0, 0], i32(1))  # token count mismatch
    with pytest.raises(KeyError):
        bm.append_tokens_batch(ids(9), [0], i32(1))
    bm.check_invariants()
