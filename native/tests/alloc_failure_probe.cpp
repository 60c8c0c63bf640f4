// The strong guarantee under allocation failure: a BlockManager call that throws std::bad_alloc
// leaves every sequence as it was. The global operator new below fails the k-th allocation
// once armed; each case is run for k = 0, 1, ... until the call no longer fails. A binary of its
// own, since it replaces operator new for everything linked into it.
#include <gtest/gtest.h>

#include <cstdlib>
#include <new>
#include <vector>

#include "pagedinfer/block_manager.h"

namespace {
long g_fail_in = -1;  // allocations left before the one that fails; -1: never fail
}  // namespace

void* operator new(std::size_t size) {
  if (g_fail_in >= 0 && g_fail_in-- == 0) throw std::bad_alloc();
  if (void* p = std::malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace pagedinfer {
namespace {

struct State {
  std::vector<std::vector<int32_t>> blocks, tokens;
  int32_t free_blocks;
  bool operator==(const State& o) const {
    return blocks == o.blocks && tokens == o.tokens && free_blocks == o.free_blocks;
  }
};

State state_of(const BlockManager& bm, const std::vector<int64_t>& ids) {
  State s{{}, {}, bm.num_free_blocks()};
  for (int64_t id : ids) {
    s.blocks.push_back(bm.sequence(id).blocks);
    s.tokens.push_back(bm.sequence(id).tokens);
  }
  return s;
}

// Four holders of one half-filled block (so the batch copies it three times) and a fifth
// sequence that needs a new block.
BlockManager make_shared_group(std::vector<int64_t>* ids) {
  BlockManager bm(32, 4, false);
  std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6};
  bm.add_sequence(1, prompt.data(), prompt.size());
  for (int64_t child : {2, 3, 4}) bm.fork(1, child);
  std::vector<int32_t> other = {9, 9, 9, 9};
  bm.add_sequence(5, other.data(), other.size());
  *ids = {1, 2, 3, 4, 5};
  return bm;
}

template <typename Call>
int failure_points(Call call) {
  int failed = 0;
  for (long k = 0; k < 1000; ++k) {
    std::vector<int64_t> ids;
    BlockManager bm = make_shared_group(&ids);
    State before = state_of(bm, ids);
    g_fail_in = k;
    bool threw = false;
    try {
      call(bm);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    g_fail_in = -1;
    if (!threw) return failed;
    ++failed;
    EXPECT_EQ(state_of(bm, ids), before) << "allocation " << k << " failed";
    EXPECT_NO_THROW(bm.check_invariants()) << "allocation " << k << " failed";
  }
  ADD_FAILURE() << "the call kept failing";
  return failed;
}

TEST(AllocationFailure, AppendBatchChangesNothing) {
  std::vector<int64_t> ids = {1, 2, 3, 4, 5};
  std::vector<int32_t> counts = {1, 1, 1, 1, 1}, tokens = {7, 8, 9, 10, 11};
  int failed = failure_points([&](BlockManager& bm) {
    bm.append_tokens_batch(ids.data(), counts.data(), ids.size(), tokens.data(), tokens.size());
  });
  EXPECT_GT(failed, 0);  // (the probe reached the call's allocations)
}

TEST(AllocationFailure, AppendChangesNothing) {
  std::vector<int32_t> tokens = {7, 8, 9};
  int failed = failure_points([&](BlockManager& bm) { bm.append_tokens(2, tokens.data(), 3); });
  EXPECT_GT(failed, 0);
}

}  // namespace
}  // namespace pagedinfer
