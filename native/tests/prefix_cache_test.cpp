#include "pagedinfer/prefix_cache.h"

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

namespace pagedinfer {
namespace {

TEST(ChainHash, DependsOnParentAndEveryToken) {
  std::vector<int32_t> a = {1, 2, 3, 4, 5};
  std::vector<int32_t> b = {1, 2, 3, 4, 6};
  uint64_t ha = chain_hash(kRootHash, a.data(), 5);
  EXPECT_EQ(ha, chain_hash(kRootHash, a.data(), 5));
  EXPECT_NE(ha, chain_hash(kRootHash, b.data(), 5));
  EXPECT_NE(ha, chain_hash(ha, a.data(), 5));
  EXPECT_NE(ha, chain_hash(kRootHash, a.data(), 4));
}

TEST(PrefixCache, InsertFindEraseKeepsProbeChains) {
  PrefixCache cache(64);
  std::mt19937_64 rng(7);
  std::vector<uint64_t> hashes(64);
  // Force collisions on the table's low bits so erase must shift entries back.
  for (auto& h : hashes) h = (rng() << 8) | 3;
  for (int32_t b = 0; b < 64; ++b) cache.insert(b, hashes[b], -1);
  EXPECT_EQ(cache.size(), 64);
  for (int32_t b = 0; b < 64; b += 2) cache.erase(b);
  for (int32_t b = 0; b < 64; ++b) {
    EXPECT_EQ(cache.find(hashes[b]), b % 2 ? b : -1) << b;
    EXPECT_EQ(cache.is_registered(b), b % 2 == 1);
  }
}

TEST(PrefixCache, ChildOfTracksParentRegistration) {
  PrefixCache cache(4);
  cache.insert(0, 10, -1);
  cache.insert(1, 11, 0);
  EXPECT_TRUE(cache.is_child_of(1, 0));
  EXPECT_TRUE(cache.has_valid_parent(1));
  cache.erase(0);
  EXPECT_FALSE(cache.has_valid_parent(1));
  cache.insert(0, 10, -1);  // same block, new registration: the old child stays orphaned
  EXPECT_FALSE(cache.is_child_of(1, 0));
  EXPECT_TRUE(cache.is_child_of(0, -1));
}

}  // namespace
}  // namespace pagedinfer
