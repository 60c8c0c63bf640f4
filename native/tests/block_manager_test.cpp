#include "pagedinfer/block_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

namespace pagedinfer {
namespace {

std::vector<int32_t> iota(int32_t n, int32_t start = 0) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

int64_t add(BlockManager& bm, int64_t id, const std::vector<int32_t>& tokens) {
  return bm.add_sequence(id, tokens.data(), static_cast<int64_t>(tokens.size()));
}

std::optional<BlockCopy> append(BlockManager& bm, int64_t id, const std::vector<int32_t>& tokens) {
  return bm.append_tokens(id, tokens.data(), static_cast<int64_t>(tokens.size()));
}

void computed(BlockManager& bm, int64_t id, int32_t n) { bm.mark_computed(&id, &n, 1); }

TEST(BlockManager, AddAllocatesAndFreeReturns) {
  BlockManager bm(8, 4, true);
  EXPECT_EQ(add(bm, 1, iota(10)), 0);
  EXPECT_EQ(bm.sequence(1).blocks, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(bm.num_free_blocks(), 5);
  bm.free(1);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_THROW(bm.free(1), UnknownSequenceError);
  bm.check_invariants();
}

TEST(BlockManager, OutOfBlocksIsAtomic) {
  BlockManager bm(3, 4, true);
  add(bm, 1, iota(6));
  EXPECT_THROW(add(bm, 2, iota(9)), OutOfBlocksError);
  EXPECT_FALSE(bm.has_sequence(2));
  EXPECT_THROW(append(bm, 1, iota(11)), OutOfBlocksError);
  EXPECT_EQ(bm.sequence(1).tokens.size(), 6u);
  EXPECT_EQ(bm.num_free_blocks(), 1);
  bm.check_invariants();
}

TEST(BlockManager, CopyOnWriteOnSharedPartialBlock) {
  BlockManager bm(8, 4, true);
  add(bm, 1, iota(6));
  bm.fork(1, 2);
  EXPECT_EQ(bm.blocks_needed_to_append(2, 1), 1);
  auto copied = append(bm, 2, {42});
  ASSERT_TRUE(copied.has_value());
  EXPECT_EQ(*copied, (BlockCopy{1, 2}));
  EXPECT_EQ(bm.block_tokens(2)[1], 5);  // copied content
  EXPECT_EQ(bm.block_tokens(2)[2], 42);
  EXPECT_EQ(bm.block_tokens(1)[2], 0);  // the parent's block is untouched
  EXPECT_FALSE(append(bm, 1, {7}).has_value());
  EXPECT_EQ(bm.stats().cow_copies, 1);
  bm.check_invariants();
}

TEST(BlockManager, AppendBatchIsExactAndAtomic) {
  BlockManager bm(5, 4, true);
  add(bm, 1, iota(6));
  bm.fork(1, 2);
  bm.fork(1, 3);
  std::vector<int64_t> ids = {1, 2, 3};
  std::vector<int32_t> counts = {1, 1, 1}, tokens = {7, 8, 9};
  // Three writers into a block held three times: two copies, the last writes in place.
  EXPECT_EQ(bm.blocks_needed_to_append_batch(ids.data(), counts.data(), 3), 2);
  // Two of the three write: both copy (the third still holds the block).
  EXPECT_EQ(bm.blocks_needed_to_append_batch(ids.data(), counts.data(), 2), 2);
  auto copies = bm.append_tokens_batch(ids.data(), counts.data(), 3, tokens.data(), 3);
  EXPECT_EQ(copies, (std::vector<BlockCopy>{{1, 2}, {1, 3}}));
  EXPECT_EQ(bm.sequence(3).blocks, (std::vector<int32_t>{0, 1}));
  std::vector<int32_t> big = {3, 3}, six(6, 0);
  EXPECT_THROW(bm.append_tokens_batch(ids.data(), big.data(), 2, six.data(), 6), OutOfBlocksError);
  EXPECT_EQ(bm.sequence(1).tokens.size(), 7u);
  std::vector<int64_t> twice = {1, 1};
  EXPECT_THROW(bm.append_tokens_batch(twice.data(), counts.data(), 2, tokens.data(), 2),
               std::invalid_argument);
  EXPECT_THROW(bm.append_tokens_batch(ids.data(), counts.data(), 3, tokens.data(), 2),
               std::invalid_argument);
  bm.check_invariants();
}

TEST(BlockManager, PrefixCacheNeedsComputedBlocks) {
  BlockManager bm(16, 4, true);
  add(bm, 1, iota(10));
  EXPECT_EQ(add(bm, 2, iota(10)), 0);
  computed(bm, 1, 10);
  EXPECT_EQ(add(bm, 3, iota(10)), 8);
  EXPECT_EQ(bm.sequence(3).blocks[0], bm.sequence(1).blocks[0]);
  EXPECT_EQ(bm.block_refcount(bm.sequence(1).blocks[0]), 2);
  bm.check_invariants();
}

TEST(BlockManager, EvictionDropsHashAndReuseIsExact) {
  BlockManager bm(4, 2, true);
  add(bm, 1, {1, 2, 3, 4});
  computed(bm, 1, 4);
  bm.free(1);
  EXPECT_EQ(bm.stats().cached_blocks, 2);
  add(bm, 2, {9, 9, 9, 9, 9, 9, 9, 9});  // needs all four blocks: evicts both cached ones
  EXPECT_EQ(bm.stats().evictions, 2);
  bm.free(2);
  EXPECT_EQ(add(bm, 3, {1, 2, 3, 4}), 0);
  bm.check_invariants();
}

TEST(BlockManager, TruncateThenAppendNeverServesStaleContent) {
  BlockManager bm(8, 4, true);
  add(bm, 1, iota(8, 1));
  computed(bm, 1, 8);
  bm.truncate(1, 6);
  append(bm, 1, {0, 0});
  EXPECT_EQ(add(bm, 2, iota(8, 1)), 4);
  EXPECT_THROW(bm.truncate(1, 9), std::invalid_argument);
  bm.check_invariants();
}

TEST(BlockManager, SetLastTokensReplacesPlaceholdersBeforeCaching) {
  BlockManager bm(8, 4, true);
  add(bm, 1, {1, 2, 3});
  add(bm, 2, {5, 6, 7, 8, 9});
  std::vector<int64_t> ids = {1, 2};
  std::vector<int32_t> placeholders = {-1, -1};
  std::vector<int32_t> counts = {1, 1};
  bm.append_tokens_batch(ids.data(), counts.data(), 2, placeholders.data(), 2);
  std::vector<int32_t> real = {4, 10};
  bm.set_last_tokens(ids.data(), real.data(), 2);
  EXPECT_EQ(bm.sequence(1).tokens.back(), 4);
  EXPECT_EQ(bm.block_tokens(bm.sequence(1).blocks[0])[3], 4);
  EXPECT_EQ(bm.block_tokens(bm.sequence(2).blocks[1])[1], 10);
  computed(bm, 1, 4);  // the block is hashed with the real token: a later prompt reuses it
  EXPECT_EQ(add(bm, 3, {1, 2, 3, 4, 0}), 4);
  // Once hashed, or shared, the last token can no longer change; nothing changes on error.
  std::vector<int64_t> hashed = {2, 1};
  std::vector<int32_t> twice = {11, 12};
  EXPECT_THROW(bm.set_last_tokens(hashed.data(), twice.data(), 2), std::invalid_argument);
  EXPECT_EQ(bm.sequence(2).tokens.back(), 10);
  bm.fork(2, 4);
  std::vector<int64_t> shared = {4};
  EXPECT_THROW(bm.set_last_tokens(shared.data(), twice.data(), 1), std::invalid_argument);
  std::vector<int64_t> dup = {2, 2};
  EXPECT_THROW(bm.set_last_tokens(dup.data(), twice.data(), 2), std::invalid_argument);
  bm.check_invariants();
}

TEST(BlockManager, SetTokensOverwritesMiddlePositionsInPlace) {
  BlockManager bm(8, 4, true);
  add(bm, 1, {1, 2, 3, 4, 5, -1, -1, -1, 9, 10});  // placeholders at 5..7 span blocks 1 and 2
  std::vector<int32_t> table = bm.sequence(1).blocks;
  std::vector<int32_t> real = {6, 7, 8};
  bm.set_tokens(1, 5, real.data(), 3);
  EXPECT_EQ(bm.sequence(1).tokens, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(bm.sequence(1).blocks, table);  // no block moved
  EXPECT_EQ(bm.block_tokens(table[1])[3], 8);
  computed(bm, 1, 8);  // hashed with the real ids: only the real prompt hits
  EXPECT_EQ(add(bm, 2, {1, 2, 3, 4, 5, 6, 7, 8, 0}), 8);
  EXPECT_EQ(add(bm, 3, {1, 2, 3, 4, 5, -1, -1, -1, 0}), 4);
  bm.check_invariants();
}

TEST(BlockManager, SetTokensRejectsBadRangesHashedAndSharedBlocks) {
  BlockManager bm(8, 4, true);
  add(bm, 1, iota(10));
  std::vector<int32_t> two = {-5, -6};
  EXPECT_THROW(bm.set_tokens(7, 0, two.data(), 2), UnknownSequenceError);
  EXPECT_THROW(bm.set_tokens(1, -1, two.data(), 2), std::invalid_argument);
  EXPECT_THROW(bm.set_tokens(1, 9, two.data(), 2), std::invalid_argument);
  bm.set_tokens(1, 8, two.data(), 2);  // up to the last token is fine
  bm.set_tokens(1, 3, two.data(), 0);  // empty: nothing to do
  computed(bm, 1, 4);
  EXPECT_THROW(bm.set_tokens(1, 3, two.data(), 2), std::invalid_argument);  // block 0 hashed
  bm.fork(1, 2);
  EXPECT_THROW(bm.set_tokens(1, 4, two.data(), 2), std::invalid_argument);  // block 1 shared
  EXPECT_EQ(bm.sequence(1).tokens, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, -5, -6}));
  bm.check_invariants();
}

TEST(BlockManager, SetTokensUnregistersATruncatedCachedBlock) {
  BlockManager bm(8, 4, true);
  add(bm, 1, iota(8));
  computed(bm, 1, 8);
  bm.truncate(1, 6);  // block 1 stays registered but is no longer hashed for the sequence
  std::vector<int32_t> one = {42};
  bm.set_tokens(1, 5, one.data(), 1);
  bm.check_invariants();  // a stale registration would fail the content-hash check
  EXPECT_EQ(add(bm, 2, iota(8)), 4);
}

TEST(BlockManager, BuildBatch) {
  BlockManager bm(16, 4, true);
  add(bm, 1, iota(10));
  add(bm, 2, iota(3));
  std::vector<int64_t> ids = {1, 2};
  std::vector<int32_t> done = {8, 0}, fresh = {2, 3};
  BatchArrays out = bm.build_batch(ids.data(), done.data(), fresh.data(), 2, -1);
  EXPECT_EQ(out.max_blocks, 3);
  std::vector<int32_t> tables(out.block_tables.data.get(), out.block_tables.data.get() + 6);
  EXPECT_EQ(tables, (std::vector<int32_t>{0, 1, 2, 3, 0, 0}));
  std::vector<int32_t> slots(out.slot_mapping.data.get(), out.slot_mapping.data.get() + 5);
  EXPECT_EQ(slots, (std::vector<int32_t>{8, 9, 12, 13, 14}));
  EXPECT_EQ(out.query_start_loc.data[2], 5);
  EXPECT_EQ(out.context_lens.data[0], 10);
  fresh[0] = 3;
  EXPECT_THROW(bm.build_batch(ids.data(), done.data(), fresh.data(), 2, -1), std::invalid_argument);
  fresh[0] = 2;
  ids[1] = 99;
  EXPECT_THROW(bm.build_batch(ids.data(), done.data(), fresh.data(), 2, -1), UnknownSequenceError);
}

TEST(BlockManager, RandomOperationsKeepInvariants) {
  BlockManager bm(32, 4, true);
  std::mt19937 rng(1);
  std::vector<int64_t> live;
  int64_t next = 0;
  for (int step = 0; step < 4000; ++step) {
    int op = static_cast<int>(rng() % 6);
    if (op == 0 || live.empty()) {
      std::vector<int32_t> tokens(rng() % 20);
      for (auto& t : tokens) t = static_cast<int32_t>(rng() % 2);
      try {
        add(bm, next, tokens);
        live.push_back(next);
      } catch (const OutOfBlocksError&) {
      }
      ++next;
      continue;
    }
    int64_t id = live[rng() % live.size()];
    int32_t len = static_cast<int32_t>(bm.sequence(id).tokens.size());
    try {
      if (op == 1) append(bm, id, {static_cast<int32_t>(rng() % 2)});
      if (op == 2) bm.fork(id, next), live.push_back(next++);
      if (op == 3) bm.truncate(id, rng() % (len + 1));
      if (op == 4) computed(bm, id, len);
    } catch (const OutOfBlocksError&) {
    }
    if (op == 5) {
      bm.free(id);
      live.erase(std::find(live.begin(), live.end(), id));
    }
    bm.check_invariants();
  }
  for (int64_t id : live) bm.free(id);
  EXPECT_EQ(bm.stats().used_blocks, 0);
  bm.check_invariants();
}

}  // namespace
}  // namespace pagedinfer
