#include "pagedinfer/block_pool.h"

namespace pagedinfer {

BlockPool::BlockPool(int32_t num_blocks)
    : refcount_(num_blocks, 0),
      lru_prev_(num_blocks, -1),
      lru_next_(num_blocks, -1),
      in_lru_(num_blocks, 0) {
  free_list_.reserve(num_blocks);
  for (int32_t block = num_blocks - 1; block >= 0; --block) free_list_.push_back(block);
}

void BlockPool::push_lru(int32_t block) {
  assert(refcount_[block] == 0 && !in_lru_[block]);
  in_lru_[block] = 1;
  lru_prev_[block] = lru_tail_;
  lru_next_[block] = -1;
  if (lru_tail_ >= 0) {
    lru_next_[lru_tail_] = block;
  } else {
    lru_head_ = block;
  }
  lru_tail_ = block;
  ++num_lru_;
}

void BlockPool::unlink(int32_t block) {
  assert(in_lru_[block]);
  int32_t prev = lru_prev_[block];
  int32_t next = lru_next_[block];
  if (prev >= 0) {
    lru_next_[prev] = next;
  } else {
    lru_head_ = next;
  }
  if (next >= 0) {
    lru_prev_[next] = prev;
  } else {
    lru_tail_ = prev;
  }
  lru_prev_[block] = lru_next_[block] = -1;
  in_lru_[block] = 0;
  --num_lru_;
}

std::vector<int32_t> BlockPool::lru_order() const {
  std::vector<int32_t> order;
  order.reserve(num_lru_);
  for (int32_t block = lru_head_; block >= 0; block = lru_next_[block]) order.push_back(block);
  return order;
}

}  // namespace pagedinfer
