#include "pagedinfer/block_pool.h"

#include <gtest/gtest.h>

#include <vector>

namespace pagedinfer {
namespace {

TEST(BlockPool, FreeListGivesLowestIdsFirst) {
  BlockPool pool(4);
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_EQ(pool.pop_free(), 0);
  EXPECT_EQ(pool.pop_free(), 1);
  EXPECT_EQ(pool.refcount(1), 1);
  EXPECT_EQ(pool.num_available(), 2);
}

TEST(BlockPool, LruEvictsLeastRecentlyReleased) {
  BlockPool pool(3);
  for (int i = 0; i < 3; ++i) pool.pop_free();
  for (int32_t b : {2, 0, 1}) {
    EXPECT_EQ(pool.decref(b), 0);
    pool.push_lru(b);
  }
  EXPECT_EQ(pool.lru_order(), (std::vector<int32_t>{2, 0, 1}));
  pool.incref(0);  // revived: leaves the LRU list from the middle
  EXPECT_EQ(pool.lru_order(), (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(pool.pop_lru(), 2);
  EXPECT_EQ(pool.num_evictable(), 1);
  pool.evictable_to_free(1);
  EXPECT_EQ(pool.num_evictable(), 0);
  EXPECT_EQ(pool.pop_free(), 1);
}

TEST(BlockPool, RefcountsCount) {
  BlockPool pool(2);
  int32_t b = pool.pop_free();
  pool.incref(b);
  EXPECT_EQ(pool.refcount(b), 2);
  EXPECT_EQ(pool.decref(b), 1);
  EXPECT_EQ(pool.decref(b), 0);
  pool.push_free(b);
  EXPECT_EQ(pool.num_free(), 2);
}

}  // namespace
}  // namespace pagedinfer
